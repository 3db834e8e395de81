"""The ``triton`` attention backend: llmkit's GPU data plane for attention.

Per layer and step:

1. ``reshape_and_cache`` writes the step's K/V into the paged cache at ``slot_mapping``;
2. a batch of decodes only (every request brings one token) runs ``paged_decode_attention``,
   split over the KV length (flash-decoding, + its reduce kernel) when there are too few
   (sequence, KV head) pairs to fill the GPU; any other batch -- prefills, chunked prefills and
   decodes mixed -- runs ``unified_attention`` in one launch.

Per-step work that every layer shares (the query tile map, the split count, device copies of
the metadata tensors) is made once, by the first layer, and kept on the step's
:class:`TritonAttentionMetadata`.

The KV cache layout is the interface's default ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``: a ``BLOCK_N x head_dim`` tile of one KV head is ``BLOCK_N`` rows of ``head_dim``
contiguous elements, which is what the kernels load.

On a CUDA device the kernels compile; elsewhere they run only under Triton's interpreter
(``TRITON_INTERPRET=1``, for tests): :meth:`TritonAttentionBackend.check_available` says so when
the engine is assembled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata
from llmkit.kernels import _jit


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    """The step's metadata plus whether it is decode-only (what the kernels derive from it,
    filled lazily by the first layer, is the base's ``derived``)."""

    decode_only: bool = False
    # A step graph's decode step: no host-side lengths to plan KV splits from.
    fixed_num_splits: int | None = None


def _extend(metadata: AttentionMetadata) -> TritonAttentionMetadata:
    decode_only = metadata.max_query_len == 1 and metadata.num_actual_tokens == metadata.num_reqs
    return TritonAttentionMetadata(**metadata.base_fields(), decode_only=decode_only)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    kv_cache_dtypes = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8", "int8")

    #: Flash-decoding: programs to aim for (None: 2x the GPU's SM count; 1 in the interpreter,
    #: i.e. no split), minimum tokens per split and most splits.
    kv_split_target_programs: int | None = None
    kv_split_min_len: int = 128
    kv_split_max: int = 16

    @classmethod
    def check_available(cls, platform) -> str | None:
        return _jit.unavailable_reason(platform.device)

    def build_metadata(self, metadata: AttentionMetadata) -> TritonAttentionMetadata:
        return _extend(metadata)

    @property
    def supports_step_graphs(self) -> bool:  # type: ignore[override]
        # Under Triton's interpreter (TRITON_INTERPRET=1, a CPU) a kernel launch is Python
        # that runs numpy on the tensors' storage: neither inductor's tracing nor a CUDA graph
        # capture can take it in, so such a backend reports no graph-safe decode and the
        # platform runs decode steps eagerly (with its warning). Compiled kernels can.
        return not _jit.interpreter_enabled()

    def decode_metadata(self, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor) -> TritonAttentionMetadata:
        rows = slot_mapping.shape[0]
        return TritonAttentionMetadata(
            num_reqs=rows, num_actual_tokens=rows, max_query_len=1, max_seq_len=0,
            query_start_loc=seq_lens, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=slot_mapping, query_start_loc_cpu=[], seq_lens_cpu=[], block_size=0,
            decode_only=True, fixed_num_splits=1)

    # -- per-step derived data, made by the first layer ------------------------------------
    @staticmethod
    def _meta(metadata: AttentionMetadata) -> TritonAttentionMetadata:
        if isinstance(metadata, TritonAttentionMetadata):
            return metadata
        # A caller that skipped build_metadata: derived data is then remade per layer.
        return _extend(metadata)

    @staticmethod
    def _on_device(meta: TritonAttentionMetadata, device: torch.device) -> dict:
        key = ("tensors", str(device))
        t = meta.derived.get(key)
        if t is None:
            def move(x: torch.Tensor) -> torch.Tensor:
                return x.to(device, non_blocking=True)
            t = meta.derived[key] = {
                "query_start_loc": move(meta.query_start_loc),
                "seq_lens": move(meta.seq_lens),
                "block_table": move(meta.block_table),
                "slot_mapping": move(meta.slot_mapping),
            }
        return t

    def _num_splits(self, meta: TritonAttentionMetadata, num_kv_heads: int,
                    device: torch.device) -> int:
        if meta.fixed_num_splits is not None:
            return meta.fixed_num_splits
        key = ("splits", num_kv_heads)
        n = meta.derived.get(key)
        if n is None:
            from llmkit.kernels.split_kv import device_num_splits

            n = meta.derived[key] = device_num_splits(
                device, meta.num_reqs, num_kv_heads, meta.max_seq_len,
                target_programs=self.kv_split_target_programs,
                min_split_len=self.kv_split_min_len, max_splits=self.kv_split_max)
        return n

    @staticmethod
    def _tiles(meta: TritonAttentionMetadata, group: int, device: torch.device):
        from llmkit.kernels.unified import choose_block_q, unified_attention_tiles

        block_q = choose_block_q(meta.max_query_len, group)
        key = ("tiles", block_q, str(device))
        tiles = meta.derived.get(key)
        if tiles is None:
            seq, qoff = unified_attention_tiles(meta.query_start_loc_cpu, block_q, device)
            tiles = meta.derived[key] = (seq, qoff, block_q)
        return tiles

    # -- forward ---------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        from llmkit.kernels.cache import reshape_and_cache
        from llmkit.kernels.decode_attention import paged_decode_attention
        from llmkit.kernels.unified import unified_attention

        meta = self._meta(metadata)
        n = meta.num_actual_tokens
        dev = self._on_device(meta, q.device)
        reshape_and_cache(k[:n], v[:n], kv_cache, dev["slot_mapping"][:n])
        out = torch.empty_like(q)
        if n == 0:
            return out
        num_kv_heads = kv_cache.shape[3]
        q = q if q.stride(-1) == 1 else q.contiguous()
        if meta.decode_only:
            # One token per request, in request order: q rows are the requests.
            paged_decode_attention(
                q[:n], kv_cache, dev["block_table"], dev["seq_lens"], scale,
                num_splits=self._num_splits(meta, num_kv_heads, q.device), out=out[:n],
                sliding_window=sliding_window, soft_cap=logits_soft_cap)
        else:
            unified_attention(
                q[:n], kv_cache, dev["query_start_loc"], dev["seq_lens"], dev["block_table"],
                scale, out=out[:n],
                tiles=self._tiles(meta, q.shape[1] // num_kv_heads, q.device),
                sliding_window=sliding_window, soft_cap=logits_soft_cap)
        return out
