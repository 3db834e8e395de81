"""llmkit's model against Hugging Face's logits: the model built as the engine builds it
(``load_llmkit``), driven over several sequences through a hand-allocated paged KV cache
(``PagedRun``), and HF's logits of the same token ids (``hf_logits``)."""
from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import MLASpec
from llmkit.attention.cpu_backend import CpuAttentionBackend
from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.config.schema import ModelConfig, PlatformConfig
from llmkit.linear.cpu_linear import CpuLinearMethod
from llmkit.models.base import ModelContext
from llmkit.models.loader import build_model, resolve_model_source
from llmkit.platforms.cpu import CpuPlatform

BLOCK_SIZE = 4
ATOL = 1e-4


class PagedRun:
    """Drives a model over several sequences with a hand-allocated paged KV cache: sequence i
    owns blocks ``[i * per_seq, (i + 1) * per_seq)``, allocated in reverse so that block ids
    are not in token order."""

    def __init__(self, model, num_seqs: int, max_len: int) -> None:
        self.model = model
        per_seq = -(-max_len // BLOCK_SIZE)
        num_blocks = num_seqs * per_seq

        def cache(spec) -> torch.Tensor:  # an MLA layer keeps one latent row per token
            if isinstance(spec, MLASpec):
                return torch.zeros(num_blocks, BLOCK_SIZE, spec.latent_dim)
            return torch.zeros(model.attn_backend.kv_cache_shape(
                num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim))

        self.kv_caches = [cache(spec) for spec in model.kv_cache_specs()]
        self.blocks = [list(reversed(range(i * per_seq, (i + 1) * per_seq)))
                       for i in range(num_seqs)]
        self.computed = [0] * num_seqs

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step over ``{seq: new token ids}``; the logits of every new token per seq."""
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in chunks.items():
            start = self.computed[seq]
            for p in range(start, start + len(tokens)):
                positions.append(p)
                slots.append(self.blocks[seq][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += tokens
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(self.blocks[seq])
            self.computed[seq] += len(tokens)
        md = AttentionMetadata(
            num_reqs=len(chunks), num_actual_tokens=len(ids),
            max_query_len=max(len(t) for t in chunks.values()), max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=BLOCK_SIZE)
        md = self.model.attn_backend.build_metadata(md)  # once per step, as the runner does
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, md)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.vocab_size)
        return {seq: logits[qsl[i]:qsl[i + 1]] for i, seq in enumerate(chunks)}


def load_llmkit(path: Path, dtype=torch.float32, kernels: str = "torch"):
    """The model built as the engine builds it, over one op set and linear method:

    - ``torch``: the torch reference ops and ``F.linear`` with the torch attention backend;
    - ``packed``: torch ops, the CPU linear method without C++ kernels (oneDNN-packed weights
      up to 512 rows, MKL above) and the ``cpu`` backend;
    - ``native``: the CPU platform's choice: its C++ ops and the CPU linear method with the
      C++ small-batch linear (up to 8 rows) in front of the packed GEMMs.
    """
    source = resolve_model_source(ModelConfig(path=str(path)))
    if kernels == "torch":
        ctx = ModelContext(TorchAttentionBackend(), dtype)
    elif kernels == "packed":
        ctx = ModelContext(CpuAttentionBackend(), dtype,
                           linear_method=lambda spec: CpuLinearMethod(None))
    else:
        platform = CpuPlatform(PlatformConfig(name="cpu", native_kernels="on"))
        ops = platform.ops(dtype)
        ctx = ModelContext(CpuAttentionBackend(ops), dtype, ops,
                           platform.linear_method_factory(dtype))
    return build_model(source, ctx, torch.device("cpu")), source


def hf_logits(model_dir: Path, seqs: list[list[int]], dtype=torch.float32,
              **kwargs) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs)
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0].float() for s in seqs]


def random_seqs(vocab: int, lens, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max |logit difference| {diff:.3g} > {atol}"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
