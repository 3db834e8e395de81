"""The recurrent hybrid (Bamba: Mamba-2 mixers + attention layers) against Hugging Face
transformers on a tiny random checkpoint: logits of flat multi-request batches through grouped
caches (the attention layers' paged K/V, the mixers' per-request state blocks) under prefill,
chunked prefill mixed with decodes and one-row decode."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmkit.attention.kv_spec import FullAttentionSpec, RecurrentStateSpec
from helpers.greedy_engine import assert_grouped_blocks_back, hf_greedy, llm_greedy
from helpers.model_logits import (PagedRun, assert_bf16_as_accurate_as_hf, assert_close,
                                  assert_prefill_matches, assert_schedule_matches, hf_logits,
                                  load_llmkit, random_seqs)
from helpers.tiny_bamba import ATTN_LAYERS, build_bamba_dir


@pytest.fixture(scope="module")
def bamba_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return build_bamba_dir(tmp_path_factory.mktemp("tiny-bamba"), tiny_tokenizer)


class GroupedRun(PagedRun):
    """Drives the model over several sequences with hand-allocated grouped caches, as the
    runner lays them out: the attention layers' paged K/V (``PagedRun``'s: sequence i owns
    blocks in reverse order) and the Mamba layers' state tuples (sequence i's state in block
    ``2 + 3 * i``, so block ids are not request ids), each group with its own block table."""

    def __init__(self, model, num_seqs: int, max_len: int) -> None:
        self.state_blocks = [2 + 3 * i for i in range(num_seqs)]
        super().__init__(model, num_seqs, max_len)
        self.layer_to_group = tuple(int(isinstance(s, RecurrentStateSpec))
                                    for s in model.kv_cache_specs())

    def layer_cache(self, spec, num_blocks: int):
        if not isinstance(spec, RecurrentStateSpec):
            return super().layer_cache(spec, num_blocks)
        # stale values: a request's first step must not read them
        return tuple(torch.full((max(self.state_blocks) + 1, *s), 0.5) for s in spec.shapes)

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        s = self.schedule(chunks)
        # (the backend extends the attention group's metadata only: a state group's block
        # table has one column, no token slots)
        attn = self.model.attn_backend.build_metadata(self.metadata(s, s.tables, s.slots))
        state = self.metadata(s, [[self.state_blocks[q]] for q in chunks], [-1] * len(s.ids))
        md = self.metadata(s, s.tables, s.slots)
        md.group_metadata, md.layer_to_group = (attn, state), self.layer_to_group
        return self.forward(s, md)


PROMPT_LENS = (5, 19, 11)
EXTRA_TOKENS = 4
KERNELS = ("torch", "native")


@pytest.fixture(scope="module")
def case(bamba_dir, tiny_tokenizer):
    seqs = random_seqs(len(tiny_tokenizer), [n + EXTRA_TOKENS for n in PROMPT_LENS])
    models = {k: load_llmkit(bamba_dir, kernels=k)[0] for k in KERNELS}
    return SimpleNamespace(models=models, seqs=seqs, ref=hf_logits(bamba_dir, seqs))


def test_checkpoint_is_a_hybrid_with_peaked_logits(case):
    """The test checkpoint means something: both layer kinds, and greedy choices that do not
    flip on rounding (top-1 ahead of top-2 by a margin far above the tolerance)."""
    model = case.models["torch"]
    specs = model.kv_cache_specs()
    assert [i for i, s in enumerate(specs) if isinstance(s, FullAttentionSpec)] == ATTN_LAYERS
    state = specs[0]
    assert isinstance(state, RecurrentStateSpec)
    # conv: intermediate 128 + 2 groups x 2 x d_state 8 channels, d_conv - 1 = 3 inputs;
    # SSM: 8 heads x head_dim 16 x d_state 8
    assert state.shapes == ((160, 3), (8, 16, 8))
    assert state.bytes_per_token(torch.float32) == 0 and state.dtype == torch.float32
    top2 = torch.cat(case.ref).topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefill_batch_matches_hf(case, kernels):
    run = GroupedRun(case.models[kernels], len(case.seqs), max(map(len, case.seqs)))
    assert_prefill_matches(run, case.seqs, PROMPT_LENS, case.ref)


@pytest.mark.parametrize("kernels", KERNELS)
def test_chunked_prefill_and_decode_match_hf(case, kernels):
    """Prompts in chunks (the scan and conv continue from the stored state), mixed with
    decodes (the one-token update), then decode-only steps."""
    seqs = case.seqs
    run = GroupedRun(case.models[kernels], len(seqs), max(map(len, seqs)))
    p0, p1, p2 = PROMPT_LENS
    schedule = [
        {0: (0, p0), 1: (0, 7), 2: (0, 1)},  # seq 2's first chunk is one token
        {0: (p0, p0 + 1), 1: (7, 9), 2: (1, 6)},
        {0: (p0 + 1, p0 + 2), 1: (9, p1), 2: (6, p2)},
        {0: (p0 + 2, p0 + 3), 1: (p1, p1 + 1), 2: (p2, p2 + 1)},  # decode only
        {0: (p0 + 3, p0 + 4), 1: (p1 + 1, p1 + 4), 2: (p2 + 1, p2 + 4)},
    ]
    assert_schedule_matches(run, seqs, schedule, case.ref)


@pytest.mark.parametrize("kernels", KERNELS)
def test_single_sequence_decode_matches_hf(case, kernels):
    seq, p0 = case.seqs[1], PROMPT_LENS[1]
    run = GroupedRun(case.models[kernels], 2, len(seq))
    run.computed[0] = 0
    assert_close(run.step({1: seq[:p0]})[1], case.ref[1][:p0])
    for t in range(p0, len(seq)):
        assert_close(run.step({1: seq[t:t + 1]})[1], case.ref[1][t:t + 1])


@pytest.mark.parametrize("kernels", KERNELS)
def test_bfloat16_is_as_accurate_as_transformers(bamba_dir, tiny_tokenizer, kernels):
    """bf16 weights, activations and K/V (the CPU default), the state float32: prompts then
    one-token decodes, off float32 by no more than transformers' own bf16 is."""
    seqs = random_seqs(len(tiny_tokenizer), [16] * 4, seed=2)
    model, _ = load_llmkit(bamba_dir, torch.bfloat16, kernels=kernels)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    run = GroupedRun(model, len(seqs), 16)
    run.kv_caches = [kv if isinstance(kv, tuple) else kv.to(torch.bfloat16)
                     for kv in run.kv_caches]
    out = run.step({i: s[:12] for i, s in enumerate(seqs)})
    for t in range(12, 16):
        for i, row in run.step({i: s[t:t + 1] for i, s in enumerate(seqs)}).items():
            out[i] = torch.cat([out[i], row])
    assert_bf16_as_accurate_as_hf(out, bamba_dir, seqs)


def test_registered_and_refuses_tensor_parallel(bamba_dir):
    from llmkit.distributed.group import TensorParallelGroup
    from llmkit.attention.torch_backend import TorchAttentionBackend
    from llmkit.config.schema import ModelConfig
    from llmkit.models import get_model_class
    from llmkit.models.base import ModelContext
    from llmkit.models.loader import resolve_model_source

    source = resolve_model_source(ModelConfig(path=str(bamba_dir)))
    cls = get_model_class(source.hf_config)
    assert cls.__name__ == "BambaForCausalLM"
    ctx = ModelContext(TorchAttentionBackend(), tp=TensorParallelGroup(rank=0, size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        cls(source.hf_config, ctx)


# -- end to end through LLM.generate -----------------------------------------------------------
MAX_TOKENS = 20
ENGINE_PROMPT_LENS = (3, 17, 5, 40, 9, 30)


@pytest.fixture(scope="module")
def engine_case(bamba_dir, tiny_tokenizer):
    prompts = random_seqs(len(tiny_tokenizer), ENGINE_PROMPT_LENS, seed=1)
    return SimpleNamespace(prompts=prompts, refs=hf_greedy(bamba_dir, prompts, MAX_TOKENS))


def test_greedy_matches_hf_under_chunked_prefill_and_preemption(bamba_dir, engine_case):
    """16 tokens a step: prompts cross steps, so the scan and conv continue from the stored
    state; 11 blocks of 16 tokens for 12 requests of up to 60 tokens (a state block each):
    preempted requests recompute from a zero state. Each prompt twice (a repeat would be a
    prefix hit with prefix caching). The C++ kernels (the decode update's among them); the
    torch ops' path is the logits tests' above."""
    from llmkit import LLM

    llm = LLM(str(bamba_dir), dtype="float32", platform={"native_kernels": "on"},
              kv_cache={"num_blocks": 12}, scheduler={"max_num_batched_tokens": 16})
    assert llm.engine.executor.runner.kv_plan.block_size == 16
    prompts = engine_case.prompts + engine_case.prompts
    assert llm_greedy(llm, prompts, MAX_TOKENS) == engine_case.refs + engine_case.refs
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits == 0  # off for this model
    assert_grouped_blocks_back(llm)


def test_prefix_caching_is_off_and_said_at_start_up(bamba_dir, engine_case, caplog):
    from llmkit import LLM

    with caplog.at_level("WARNING"):
        llm = LLM(str(bamba_dir), dtype="float32", kv_cache={"enable_prefix_caching": True})
    assert any("enable_prefix_caching" in r.getMessage() and "off" in r.getMessage()
               for r in caplog.records)
    kv = llm.engine.kv_cache_manager
    assert not kv.enable_prefix_caching
    p = engine_case.prompts[3]  # 40 tokens (2 full blocks), asked twice one after the other
    assert llm_greedy(llm, [p], MAX_TOKENS) == [engine_case.refs[3]]
    assert llm_greedy(llm, [p], MAX_TOKENS) == [engine_case.refs[3]]
    assert llm.engine.stats().prefix_cache_hits == 0
    assert_grouped_blocks_back(llm)


def test_recurrent_state_does_not_grow_with_context(bamba_dir):
    """A request's KV bytes at 64 and at 512 tokens: the Mamba layers' group holds one block
    either way; only the attention layers' group grows."""
    from llmkit import LLM
    from llmkit.request import Request
    from llmkit.sampling.params import SamplingParams

    llm = LLM(str(bamba_dir), dtype="float32", kv_cache={"num_blocks": 64})
    kv = llm.engine.kv_cache_manager
    plan = llm.engine.executor.runner.kv_plan
    recurrent = [g for g in range(plan.num_groups) if plan.is_recurrent(g)]
    attention = [g for g in range(plan.num_groups) if not plan.is_recurrent(g)]
    assert recurrent and attention
    req = Request("r", list(range(5, 69)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, 64) is not None
    held_64 = [len(ids) for ids in kv.get_block_ids("r")]
    req.num_computed_tokens = 64
    assert kv.allocate_slots(req, 512 - 64) is not None
    held_512 = [len(ids) for ids in kv.get_block_ids("r")]
    for g in recurrent:
        assert held_64[g] == held_512[g] == 1
    for g in attention:
        assert held_512[g] == 512 // plan.block_size > held_64[g] == -(-64 // plan.block_size)
    bytes_64, bytes_512 = (sum(h) * plan.bytes_per_block for h in (held_64, held_512))
    recurrent_bytes = sum(held_64[g] for g in recurrent) * plan.bytes_per_block
    assert bytes_512 - bytes_64 == sum(held_512[g] - held_64[g] for g in attention) * \
        plan.bytes_per_block
    assert recurrent_bytes == len(recurrent) * plan.bytes_per_block
    kv.free(req)
    assert_grouped_blocks_back(llm)


def test_speculative_decoding_is_refused_naming_the_key(bamba_dir):
    from llmkit import LLM
    from llmkit.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        LLM(str(bamba_dir), dtype="float32",
            speculative={"name": "ngram", "num_speculative_tokens": 2})
    assert err.value.key == "speculative.name"
    assert "recurrent" in str(err.value)
