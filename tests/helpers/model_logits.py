"""llmkit's model against Hugging Face's logits: the model built as the engine builds it
(``load_llmkit``), driven over several sequences through a hand-allocated paged KV cache
(``PagedRun``), and HF's logits of the same token ids (``hf_logits``)."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

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
    are not in token order. A model with other state per layer overrides :meth:`layer_cache`
    and :meth:`step` (``schedule``, ``metadata`` and ``forward`` are the shared parts)."""

    def __init__(self, model, num_seqs: int, max_len: int) -> None:
        self.model = model
        per_seq = -(-max_len // BLOCK_SIZE)
        self.kv_caches = [self.layer_cache(spec, num_seqs * per_seq)
                          for spec in model.kv_cache_specs()]
        self.blocks = [list(reversed(range(i * per_seq, (i + 1) * per_seq)))
                       for i in range(num_seqs)]
        self.computed = [0] * num_seqs

    def layer_cache(self, spec, num_blocks: int):
        """One layer's cache of ``num_blocks`` pages (an MLA layer keeps one latent row per
        token)."""
        if isinstance(spec, MLASpec):
            return torch.zeros(num_blocks, BLOCK_SIZE, spec.latent_dim)
        return torch.zeros(self.model.attn_backend.kv_cache_shape(
            num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim))

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step over ``{seq: new token ids}``; the logits of every new token per seq."""
        s = self.schedule(chunks)
        md = self.metadata(s, s.tables, s.slots)
        md = self.model.attn_backend.build_metadata(md)  # once per step, as the runner does
        return self.forward(s, md)

    def schedule(self, chunks: dict[int, list[int]]) -> SimpleNamespace:
        """The step's flat batch (token ids, positions, slots, query starts, sequence lengths,
        block tables); the sequences' computed tokens advance."""
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
        return SimpleNamespace(chunks=chunks, ids=ids, positions=positions, slots=slots,
                               qsl=qsl, seq_lens=seq_lens, tables=tables)

    def metadata(self, s: SimpleNamespace, block_table, slot_mapping) -> AttentionMetadata:
        """The step's attention metadata over ``block_table`` and ``slot_mapping``."""
        return AttentionMetadata(
            num_reqs=len(s.chunks), num_actual_tokens=len(s.ids),
            max_query_len=max(len(t) for t in s.chunks.values()), max_seq_len=max(s.seq_lens),
            query_start_loc=torch.tensor(s.qsl, dtype=torch.int32),
            seq_lens=torch.tensor(s.seq_lens, dtype=torch.int32),
            block_table=torch.tensor(block_table, dtype=torch.int32),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            query_start_loc_cpu=s.qsl, seq_lens_cpu=s.seq_lens, block_size=BLOCK_SIZE)

    def forward(self, s: SimpleNamespace, md: AttentionMetadata) -> dict[int, torch.Tensor]:
        """The model over the step's batch; the logits of every new token per seq."""
        with torch.inference_mode():
            hidden = self.model(torch.tensor(s.ids), torch.tensor(s.positions), self.kv_caches,
                                md)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(s.ids),
                                                                  self.model.vocab_size)
        qsl = s.qsl
        return {seq: logits[qsl[i]:qsl[i + 1]] for i, seq in enumerate(s.chunks)}


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


def assert_prefill_matches(run: PagedRun, seqs: list[list[int]], prompt_lens,
                           ref: list[torch.Tensor]) -> None:
    """The first ``prompt_lens[i]`` tokens of every sequence in one flat batch: every
    position's logits equal the reference's."""
    prompts = [s[:n] for s, n in zip(seqs, prompt_lens)]
    out = run.step(dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        assert_close(out[i], ref[i][:len(p)])


def assert_schedule_matches(run: PagedRun, seqs: list[list[int]],
                            schedule: list[dict[int, tuple[int, int]]],
                            ref: list[torch.Tensor]) -> None:
    """Steps of ``{seq: (start, end)}`` token ranges (chunks, decodes) that cover every
    sequence whole: each step's logits equal the reference's at the same positions."""
    for step in schedule:
        out = run.step({i: seqs[i][a:b] for i, (a, b) in step.items()})
        for i, (a, b) in step.items():
            assert_close(out[i], ref[i][a:b])
    assert run.computed == [len(s) for s in seqs]


def assert_bf16_as_accurate_as_hf(out, model_dir: Path, seqs: list[list[int]]) -> None:
    """llmkit's bf16 logits (``out[i]``: every position of ``seqs[i]``) are off HF's float32
    logits by no more than HF's own bf16 logits are (mean absolute error summed over the
    sequences, x1.5 + 1e-3)."""
    ref32 = hf_logits(model_dir, seqs)
    ref16 = hf_logits(model_dir, seqs, dtype=torch.bfloat16)
    ours = sum((out[i] - ref32[i]).abs().mean().item() for i in range(len(seqs)))
    theirs = sum((ref16[i] - ref32[i]).abs().mean().item() for i in range(len(seqs)))
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)
