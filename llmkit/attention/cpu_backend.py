"""Attention over the paged cache for CPUs: decode rows read K/V in place through the block
table; prefill rows use the CPU flash SDPA kernel.

With the CPU platform's C++ kernels (``ops.paged_decode_in_place``) every decode row goes to
the ops' paged decode attention and K/V are written by the ops. Without them (torch ops):

The portable ``torch`` backend gathers every decode row's whole context into a padded tensor per
layer and step before SDPA reads it again: at batch 64 and 256 tokens of context that copy is
as large as the attention itself. Here inductor (``torch.compile``, C++ on the CPU) fuses the
block-table lookup into the score and value reductions, so each K/V byte is read once and
nothing is materialised. The kernel is compiled with dynamic batch and context sizes, warmed up
when the KV cache is allocated (compile time is logged; inductor caches it on disk, so later
start-ups load it), and shared by every layer.
"""
from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.attention.torch_backend import (DecodePlan, PrefillPlan, TorchAttentionBackend,
                                            gathered_decode_attention, plans_for_window)
from llmkit.kernels.kv_quant import format_of, read_rows
from llmkit.ops.base import ModelOps, paged_decode_attention_reference, write_kv
from llmkit.ops.masking import attention

logger = logging.getLogger(__name__)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row over its paged context.

    ``q [B, H, D]``, ``kv_cache [2, num_blocks, block_size, Hkv, D]``, ``block_table [B, nb]``
    (int64, entries past a row's length may be any valid block), ``seq_lens [B]``. Grouped-query
    heads share their K/V head. Math in float32, like SDPA's CPU kernel, result in q's dtype.
    """
    b, h, d = q.shape
    hkv = kv_cache.shape[3]
    nb, bs = block_table.shape[1], kv_cache.shape[2]
    qg = q.float().view(b, 1, 1, hkv, h // hkv, d)
    k = kv_cache[0][block_table]  # [B, nb, bs, Hkv, D]: an indirect load inside the kernel
    s = (qg * k.float()[..., None, :]).sum(-1) * scale  # [B, nb, bs, Hkv, G]
    pos = torch.arange(nb * bs, device=q.device).view(1, nb, bs)
    valid = pos < seq_lens.view(b, 1, 1)
    s = s.masked_fill(~valid[..., None, None], float("-inf"))
    e = torch.exp(s - s.amax((1, 2), keepdim=True))
    p = e / e.sum((1, 2), keepdim=True)
    v = kv_cache[1][block_table]
    o = (p[..., None] * v.float()[..., None, :]).sum((1, 2))  # [B, Hkv, G, D]
    return o.reshape(b, h, d).to(q.dtype)


class CompiledPagedDecode:
    """``paged_decode_attention`` compiled per head layout, dynamic in the batch, the context
    length and the pool size, so one kernel serves every step and layer of a model.

    Those sizes are unbacked (no 0/1 specialisation: one compile covers a single row too); head
    counts, head size and block size stay constants the C++ kernel is specialised for. Each
    layout compiles a copy of the function with its own code object, because dynamo keeps its
    compiled variants, and a limit on their number, per code object: several models in one
    process (tests, a router) would otherwise exhaust that limit. (Unbacked sizes are never
    duck-sized either: a batch that equals the number of context blocks ties nothing.)
    """

    def __init__(self) -> None:
        self._fns: dict[tuple, object] = {}

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        q = q.contiguous()  # a strided slice of the fused QKV output: one layout, one kernel
        key = (q.shape[1], *kv_cache.shape[2:], q.dtype, kv_cache.dtype, q.device.type)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = torch.compile(_function_copy(paged_decode_attention, key),
                                                fullgraph=True)
        mark = torch._dynamo.decorators.mark_unbacked
        mark(q, 0)
        mark(kv_cache, 1)
        mark(block_table, 0)
        mark(block_table, 1)
        mark(seq_lens, 0)
        return fn(q, kv_cache, block_table, seq_lens, scale)


def _function_copy(fn: Callable, key: tuple) -> Callable:
    """``fn`` with a code object of its own (see ``CompiledPagedDecode``)."""
    tag = "_".join(str(k).replace("torch.", "") for k in key)
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


@dataclass(slots=True)
class PagedDecodePlan:
    token_rows: torch.Tensor  # int64 [B]: the decode rows' query rows
    block_table: torch.Tensor  # int64 [B, nb]
    seq_lens: torch.Tensor  # int64 [B]

    def to(self, device: torch.device) -> "PagedDecodePlan":
        return PagedDecodePlan(self.token_rows.to(device), self.block_table.to(device),
                               self.seq_lens.to(device))


@dataclass(slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    # Paged (compiled kernel) for larger decode batches, gathered (torch path) for small ones.
    decode: PagedDecodePlan | DecodePlan | None = None
    prefills: list[PrefillPlan] | None = None
    all_decode: bool = False  # every row decodes and rows are in query order
    has_skipped_slots: bool | None = None  # a -1 slot among the step's tokens (checked once)
    windowed: dict = field(default_factory=dict)  # as TorchAttentionMetadata's


class CpuAttentionBackend(TorchAttentionBackend):
    """Its two row-count choices come from the platform's dispatch table
    (``llmkit.config.cpu_dispatch``); each picks between paths that give different bits, so
    they are fixed per instruction-set tier, never timed."""

    name = "cpu"

    def __init__(self, ops: ModelOps | None = None, dispatch: CpuDispatch | None = None) -> None:
        super().__init__(ops)
        dispatch = dispatch if dispatch is not None else CpuDispatch()
        # Below this many decode rows the compiled kernel has too little to spread over the
        # threads and the torch path (gather + SDPA, whose gather then fits in cache) is a
        # little faster.
        self.min_compiled_decode_rows = dispatch.attention_min_compiled_decode_rows
        # With the C++ kernels, rows of at most this many query tokens run as decode rows, one
        # per token (speculative verification: 1 + K tokens).
        self.max_expanded_query_len = dispatch.attention_max_expanded_query_len
        self._kernel = CompiledPagedDecode()
        # The ops read the block table in place at any batch size (the C++ kernels): they
        # take every decode row, and nothing is compiled at start-up.
        self._in_place = self.ops.paged_decode_in_place

    @classmethod
    def for_platform(cls, platform, ops: ModelOps | None = None) -> "CpuAttentionBackend":
        return cls(ops, dispatch=platform.dispatch)

    def build_metadata(self, m: AttentionMetadata) -> CpuAttentionMetadata:
        qsl, seq_lens, bs = m.query_start_loc_cpu, m.seq_lens_cpu, m.block_size
        decode_rows = [i for i in range(m.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        fields = m.base_fields()
        n = m.num_actual_tokens
        if self._in_place:
            return self._in_place_metadata(m, fields, decode_rows)
        fields["has_skipped_slots"] = bool(n and (m.slot_mapping[:n] < 0).any())
        if len(decode_rows) < self.min_compiled_decode_rows:
            base = super().build_metadata(m)
            return CpuAttentionMetadata(**fields, decode=base.decode, prefills=base.prefills)
        all_decode = len(decode_rows) == m.num_reqs
        rows = torch.arange(m.num_reqs) if all_decode else torch.tensor(decode_rows)
        nblk = -(-max(seq_lens[i] for i in decode_rows) // bs)
        decode = PagedDecodePlan(
            token_rows=rows if all_decode else torch.tensor([qsl[i] for i in decode_rows]),
            block_table=m.block_table[rows, :nblk].long(),
            seq_lens=m.seq_lens[rows].long())
        prefills = [] if all_decode else super().build_metadata(m).prefills
        return CpuAttentionMetadata(**fields, decode=decode, prefills=prefills,
                                    all_decode=all_decode)

    def _in_place_metadata(self, m: AttentionMetadata, fields: dict,
                         decode_rows: list[int]) -> CpuAttentionMetadata:
        qsl, seq_lens = m.query_start_loc_cpu, m.seq_lens_cpu
        # Short multi-token rows (a decoding request verifying draft tokens, a small chunk)
        # run as one decode row per token, token j seeing its row's context up to itself:
        # every K/V is written before attention, so this is the causal result, from the
        # kernel plain decoding uses (not one SDPA call per row).
        short = [i for i in range(m.num_reqs)
                 if 1 < qsl[i + 1] - qsl[i] <= self.max_expanded_query_len]
        if short:
            return self._expanded_metadata(m, fields, sorted(decode_rows + short))
        all_decode = len(decode_rows) == m.num_reqs
        decode = None
        if decode_rows:
            rows = slice(0, m.num_reqs) if all_decode else torch.tensor(decode_rows)
            nblk = -(-max(m.seq_lens_cpu[i] for i in decode_rows) // m.block_size)
            decode = PagedDecodePlan(
                token_rows=torch.tensor([qsl[i] for i in decode_rows]),
                block_table=m.block_table[rows, :nblk], seq_lens=m.seq_lens[rows])
        prefills = [] if all_decode else super().build_metadata(m).prefills
        return CpuAttentionMetadata(**fields, decode=decode, prefills=prefills,
                                    all_decode=all_decode)

    def _expanded_metadata(self, m: AttentionMetadata, fields: dict,
                           rows: list[int]) -> CpuAttentionMetadata:
        qsl, seq_lens = m.query_start_loc_cpu, m.seq_lens_cpu
        token_rows, owners, lens = [], [], []
        for i in rows:
            start, end = qsl[i], qsl[i + 1]
            first = seq_lens[i] - (end - start) + 1
            token_rows.extend(range(start, end))
            owners.extend([i] * (end - start))
            lens.extend(range(first, first + end - start))
        nblk = -(-max(seq_lens[i] for i in rows) // m.block_size)
        all_decode = len(rows) == m.num_reqs
        decode = PagedDecodePlan(
            token_rows=torch.tensor(token_rows),
            block_table=m.block_table[torch.tensor(owners), :nblk].contiguous(),
            seq_lens=torch.tensor(lens, dtype=torch.int32))
        prefills = []
        if not all_decode:
            keep = set(rows)
            prefills = [p for p in super().build_metadata(m).prefills
                        if not any(qsl[i] == p.start for i in keep)]
        return CpuAttentionMetadata(**fields, decode=decode, prefills=prefills,
                                    all_decode=all_decode)

    @property
    def supports_step_graphs(self) -> bool:  # type: ignore[override]
        return self._in_place  # the ops' kernel reads the block table at any size

    def decode_metadata(self, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor) -> CpuAttentionMetadata:
        if not self._in_place:
            return super().decode_metadata(slot_mapping, block_table, seq_lens)
        rows = slot_mapping.shape[0]
        return CpuAttentionMetadata(
            num_reqs=rows, num_actual_tokens=rows, max_query_len=1, max_seq_len=0,
            query_start_loc=None, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=slot_mapping, query_start_loc_cpu=[], seq_lens_cpu=[], block_size=0,
            decode=PagedDecodePlan(None, block_table, seq_lens), prefills=[], all_decode=True,
            has_skipped_slots=None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        if not isinstance(metadata, CpuAttentionMetadata):
            metadata = self.build_metadata(metadata)
        if metadata.slot_mapping.device != kv_cache.device:
            self._move_plans(metadata, kv_cache.device)
        n = metadata.num_actual_tokens
        in_place = self._in_place
        if in_place:
            self.ops.write_kv(k[:n], v[:n], kv_cache, metadata.slot_mapping[:n])
        else:
            write_kv(k[:n], v[:n], kv_cache, metadata.slot_mapping[:n],
                     metadata.has_skipped_slots)
        window, cap = sliding_window, logits_soft_cap
        # The C++ kernels read any cache format and take the window and the soft cap. Without
        # them a quantized cache, a window or a soft cap is read by the torch reference
        # (gather, dequantize, SDPA) rather than the compiled kernel, which has neither.
        if in_place:
            paged = self.ops.paged_decode_attention
        elif format_of(kv_cache) is not None or window is not None or cap is not None:
            paged = paged_decode_attention_reference
        else:
            paged = self._kernel
        if metadata.all_decode:
            d = metadata.decode
            if window is None and cap is None:
                return paged(q[:n], kv_cache, d.block_table, d.seq_lens, scale)
            return paged(q[:n], kv_cache, d.block_table, d.seq_lens, scale, window, cap)
        d, prefills = plans_for_window(metadata, window)
        num_kv_heads = kv_cache.shape[-2]
        flat = kv_cache.view(2, -1, num_kv_heads, kv_cache.shape[-1])  # rows: see kv_quant
        out = torch.empty_like(q)
        if isinstance(d, PagedDecodePlan):
            rows = q[d.token_rows]
            out[d.token_rows] = (
                paged(rows, kv_cache, d.block_table, d.seq_lens, scale)
                if window is None and cap is None else
                paged(rows, kv_cache, d.block_table, d.seq_lens, scale, window, cap))
        elif d is not None:
            # float32 math: the CPU SDPA kernel is ~3x slower in bf16 where bf16 is emulated,
            # and it accumulates in float32 either way
            out[d.token_rows] = gathered_decode_attention(q.float(), flat, d, scale,
                                                          cap).to(q.dtype)
        group = q.shape[1] // num_kv_heads
        for p in prefills or ():
            qt = q[p.start:p.end].transpose(0, 1)  # [H, T, D]
            # Keys that are exactly this step's new tokens (a fresh prompt, or a window of one
            # token): their own K/V, not read back
            if p.slots.shape[0] == p.end - p.start and kv_cache.dtype == k.dtype:
                kc, vc = k[p.start:p.end], v[p.start:p.end]
            else:
                # A cache that rounds (quantized, or a narrower float) is read back even by a
                # fresh prompt: every reader sees the stored values, so a prefix-cache hit or a
                # chunked prefill changes nothing.
                kc = read_rows(flat[0].index_select(0, p.slots), q.dtype)
                vc = read_rows(flat[1].index_select(0, p.slots), q.dtype)
            # The CPU flash kernel takes neither grouped-query heads nor 3-d inputs (either
            # sends SDPA to its unfused math path, ~2x slower at 1k tokens): expand K/V to
            # q's heads and add a batch dimension.
            kc = _expand_heads(kc.to(q.dtype), group).transpose(0, 1)
            vc = _expand_heads(vc.to(q.dtype), group).transpose(0, 1)
            o = attention(qt[None], kc[None], vc[None], attn_mask=p.mask,
                          is_causal=p.mask is None, scale=scale, enable_gqa=False, soft_cap=cap)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """Compile the decode kernel now rather than inside the first steps (sizes are
        unbacked, so one call covers every batch and context size). The C++ kernels need no
        compile."""
        if self._in_place or format_of(kv_cache) is not None:
            return
        t0 = time.perf_counter()
        q = torch.zeros(2, num_heads, kv_cache.shape[-1], dtype=dtype, device=kv_cache.device)
        table = torch.zeros(2, 2, dtype=torch.long, device=kv_cache.device)
        lens = torch.ones(2, dtype=torch.long, device=kv_cache.device)
        self._kernel(q, kv_cache, table, lens, 1.0)
        logger.info("CPU paged decode attention ready in %.1f s (compiled, or loaded from "
                    "inductor's cache)", time.perf_counter() - t0)


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[T, Hkv, D]`` -> ``[T, Hkv * group, D]``, each K/V head repeated for its q heads."""
    if group == 1:
        return x
    t, hkv, d = x.shape
    return x[:, :, None, :].expand(t, hkv, group, d).reshape(t, hkv * group, d)
