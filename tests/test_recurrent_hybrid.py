"""The recurrent hybrid (Bamba: Mamba-2 mixers + attention layers) against Hugging Face
transformers on a tiny random checkpoint: logits of flat multi-request batches through grouped
caches (the attention layers' paged K/V, the mixers' per-request state blocks) under prefill,
chunked prefill mixed with decodes and one-row decode."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import FullAttentionSpec, RecurrentStateSpec
from helpers.model_logits import assert_close, hf_logits, load_llmkit, random_seqs

BLOCK_SIZE = 4
ATTN_LAYERS = [1, 4]
# Non-default values the test must exercise: two B/C groups, an SSD chunk shorter than the
# prompts (the scan crosses chunk boundaries inside a prompt), a bias on the conv. A state
# small beside a token's K/V (d_state 8, 4 KV heads) keeps the pool's blocks at 16 tokens
# (the runner raises the block size until an attention page holds a state).
BAMBA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5,
             attn_layer_indices=ATTN_LAYERS, num_attention_heads=4, num_key_value_heads=4,
             mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2, mamba_d_state=8,
             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_conv_bias=True,
             max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
# The SSM's own parameters keep transformers' init (A = -1..-n_heads, dt_bias 1, D 1): scaled
# by 3 they would make A = -n^3 and every head forget within a token.
KEEP_INIT = ("A_log", "dt_bias", ".D")


def build_bamba_dir(out: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A tiny random Bamba saved with safetensors and ``tokenizer`` (weights x3 as in
    ``helpers.tiny_models``, except the SSM's decay parameters)."""
    from transformers import AutoModelForCausalLM, BambaConfig

    config = BambaConfig(**{**BAMBA, "vocab_size": len(tokenizer),
                            "bos_token_id": tokenizer.bos_token_id,
                            "eos_token_id": tokenizer.eos_token_id,
                            "pad_token_id": tokenizer.pad_token_id, **overrides})
    config.architectures = ["BambaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(KEEP_INIT):
                continue
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
            param.mul_(3.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def bamba_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return build_bamba_dir(tmp_path_factory.mktemp("tiny-bamba"), tiny_tokenizer)


class GroupedRun:
    """Drives the model over several sequences with hand-allocated grouped caches, as the
    runner lays them out: the attention layers' paged K/V (sequence i owns blocks in reverse
    order) and the Mamba layers' state tuples (sequence i's state in block ``2 + 3 * i``, so
    block ids are not request ids), each group with its own block table."""

    def __init__(self, model, num_seqs: int, max_len: int) -> None:
        self.model = model
        specs = model.kv_cache_specs()
        per_seq = -(-max_len // BLOCK_SIZE)
        self.state_blocks = [2 + 3 * i for i in range(num_seqs)]
        num_state_blocks = max(self.state_blocks) + 1
        self.kv_caches = []
        for spec in specs:
            if isinstance(spec, RecurrentStateSpec):
                # stale values: a request's first step must not read them
                self.kv_caches.append(tuple(torch.full((num_state_blocks, *s), 0.5)
                                            for s in spec.shapes))
            else:
                shape = model.attn_backend.kv_cache_shape(num_seqs * per_seq, BLOCK_SIZE,
                                                          spec.num_kv_heads, spec.head_dim)
                self.kv_caches.append(torch.zeros(shape))
        self.layer_to_group = tuple(int(isinstance(s, RecurrentStateSpec)) for s in specs)
        self.blocks = [list(reversed(range(i * per_seq, (i + 1) * per_seq)))
                       for i in range(num_seqs)]
        self.computed = [0] * num_seqs

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
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

        def metadata(block_table, slot_mapping) -> AttentionMetadata:
            return AttentionMetadata(
                num_reqs=len(chunks), num_actual_tokens=len(ids),
                max_query_len=max(len(t) for t in chunks.values()), max_seq_len=max(seq_lens),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_table=torch.tensor(block_table, dtype=torch.int32),
                slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
                query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=BLOCK_SIZE)

        # (the backend extends the attention group's metadata only: a state group's block
        # table has one column, no token slots)
        attn = self.model.attn_backend.build_metadata(metadata(tables, slots))
        state = metadata([[self.state_blocks[s]] for s in chunks], [-1] * len(ids))
        md = metadata(tables, slots)
        md.group_metadata, md.layer_to_group = (attn, state), self.layer_to_group
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, md)
            logits = self.model.compute_logits(hidden)
        return {seq: logits[qsl[i]:qsl[i + 1]] for i, seq in enumerate(chunks)}


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
    prompts = [s[:n] for s, n in zip(case.seqs, PROMPT_LENS)]
    out = run.step(dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        assert_close(out[i], case.ref[i][:len(p)])


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
    for step in schedule:
        out = run.step({i: seqs[i][a:b] for i, (a, b) in step.items()})
        for i, (a, b) in step.items():
            assert_close(out[i], case.ref[i][a:b])
    assert run.computed == [len(s) for s in seqs]


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
    ref32 = hf_logits(bamba_dir, seqs)
    ref16 = hf_logits(bamba_dir, seqs, dtype=torch.bfloat16)
    ours = sum((out[i] - ref32[i]).abs().mean().item() for i in range(len(seqs)))
    theirs = sum((ref16[i] - ref32[i]).abs().mean().item() for i in range(len(seqs)))
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


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


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own generate (its cache: the chunked scan over the prompt, then the
    one-token recurrent update per token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def engine_case(bamba_dir, tiny_tokenizer):
    prompts = random_seqs(len(tiny_tokenizer), ENGINE_PROMPT_LENS, seed=1)
    return SimpleNamespace(prompts=prompts, refs=hf_greedy(bamba_dir, prompts, MAX_TOKENS))


def _generate(llm, prompts):
    from llmkit import SamplingParams

    return [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]


def _all_blocks_back(llm) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks - 1  # all but the null block


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
    assert _generate(llm, prompts) == engine_case.refs + engine_case.refs
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits == 0  # off for this model
    _all_blocks_back(llm)


def test_prefix_caching_is_off_and_said_at_start_up(bamba_dir, engine_case, caplog):
    from llmkit import LLM

    with caplog.at_level("WARNING"):
        llm = LLM(str(bamba_dir), dtype="float32", kv_cache={"enable_prefix_caching": True})
    assert any("enable_prefix_caching" in r.getMessage() and "off" in r.getMessage()
               for r in caplog.records)
    kv = llm.engine.kv_cache_manager
    assert not kv.enable_prefix_caching
    p = engine_case.prompts[3]  # 40 tokens (2 full blocks), asked twice one after the other
    assert _generate(llm, [p]) == [engine_case.refs[3]]
    assert _generate(llm, [p]) == [engine_case.refs[3]]
    assert llm.engine.stats().prefix_cache_hits == 0
    _all_blocks_back(llm)


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
    _all_blocks_back(llm)


def test_speculative_decoding_is_refused_naming_the_key(bamba_dir):
    from llmkit import LLM
    from llmkit.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        LLM(str(bamba_dir), dtype="float32",
            speculative={"name": "ngram", "num_speculative_tokens": 2})
    assert err.value.key == "speculative.name"
    assert "recurrent" in str(err.value)
