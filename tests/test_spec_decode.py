"""Speculative decoding end to end (issue "Speculative decoding"): the n-gram, draft-model and
EAGLE proposers through the public ``LLM`` API, against the engine without speculation (greedy
tokens and logprobs), against from-scratch references of the draft model and the EAGLE head
(their KV in the target's blocks), and against the target's exact distribution (chi-square)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.scheduler import TokenBudgetScheduler
from llmkit.scheduler.base import Scheduler
from llmkit.spec_decode.base import Proposer
from llmkit.spec_decode.ngram import find_drafts
from helpers.tiny_models import (SUCCESSOR_PROMPTS, build_eagle_head_dir,
                                  build_successor_model_dir)

MAX_TOKENS = 24
PROMPTS = SUCCESSOR_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# a small pool (preemption and recompute), a small token budget (prompts in chunks, drafts cut
# to the budget), blocks of 4 (prefix hits on the shared prefix)
STRESS = {"kv_cache": {"num_blocks": 24, "block_size": 4},
          "scheduler": {"max_num_batched_tokens": 10}}


# -- helpers -------------------------------------------------------------------------------
def make_llm(model_dir, **groups) -> LLM:
    return LLM(str(model_dir), dtype="float32", **groups)


def checked(llm: LLM) -> LLM:
    """Check the KV pool's integrity after every step's proposal."""
    runner = llm.engine.executor.runner
    proposer = runner.proposer
    if proposer is not None:
        kv, propose = llm.engine.kv_cache_manager, proposer.propose

        def wrapped(batch, rows, step=None):
            out = propose(batch, rows, step)
            kv.check_integrity()
            return out
        proposer.propose = wrapped
    return llm


def generate(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks  # every block back, draft slots included
    return outs


def assert_same(got, want, tol: float = 1e-4) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs or (), w.outputs[0].logprobs or ()):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert abs(lg[t].logprob - lw[t].logprob) <= tol


class Recorder:
    """Wraps a proposer: records (tokens so far, drafts) of every proposal."""

    def __init__(self, proposer: Proposer) -> None:
        self.records: list[tuple[tuple[int, ...], list[int]]] = []
        propose = proposer.propose

        def wrapped(batch, rows, step=None):
            out = propose(batch, rows, step)
            for rid, drafts in out.items():
                row = batch.req_id_to_row[rid]
                self.records.append((tuple(batch.token_ids[row, :batch.num_tokens[row]]
                                           .tolist()), list(drafts)))
            return out
        proposer.propose = wrapped


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir):
    return tiny_model_dir("llama", seed=1)


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory, model_dir):
    """The target with noise on its weights: a draft whose distribution overlaps the
    target's without being it (q != p, both spread over the same few tokens)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near-draft")
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(5)
    weights = {k: (v + 0.1 * v.std() * torch.randn(v.shape, generator=gen)).contiguous()
               if v.dim() == 2 else v for k, v in load_file(str(model_dir /
                                                               "model.safetensors")).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def succ_dir(tmp_path_factory, tiny_tokenizer):
    return build_successor_model_dir(tmp_path_factory.mktemp("succ"), tiny_tokenizer)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, model_dir):
    return build_eagle_head_dir(model_dir, tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def references(model_dir, succ_dir):
    """Greedy outputs without speculation, per model."""
    return {name: generate(make_llm(d), PROMPTS, GREEDY)
            for name, d in (("random", model_dir), ("succ", succ_dir))}


# -- n-gram search ---------------------------------------------------------------------------
def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if L < n + 1:
            continue
        suffix = tokens[L - n:]
        for end in range(L - 2, n - 2, -1):  # most recent first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_find_drafts_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for case in range(60):
        rows = rng.integers(1, 6)
        lengths = rng.integers(1, 40, size=rows)
        width = int(lengths.max()) + int(rng.integers(0, 3))
        tokens = rng.integers(0, 4 if case % 2 else 9, size=(rows, width))
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        max_n = min_n + int(rng.integers(0, 4))
        drafts, counts = find_drafts(tokens, lengths, k, min_n, max_n)
        for r in range(rows):
            want = _brute_force(tokens[r, :lengths[r]].tolist(), k, min_n, max_n)
            assert drafts[r, :counts[r]].tolist() == want, (case, r)


# -- greedy: the same tokens and logprobs as without speculation ----------------------------
def _spec(name, model_dir, draft_dir, eagle_dir, k):
    return {"ngram": {"name": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1},
            "draft_model": {"name": "draft_model", "num_speculative_tokens": k,
                            "model": str(draft_dir)},
            "draft_self": {"name": "draft_model", "num_speculative_tokens": k,
                           "model": str(model_dir)},
            "eagle": {"name": "eagle", "num_speculative_tokens": k, "model": str(eagle_dir)},
            }[name]


@pytest.mark.parametrize("proposer,target,stress", [
    ("ngram", "succ", False), ("ngram", "succ", True), ("ngram", "random", True),
    ("draft_self", "random", False), ("draft_self", "random", True),
    ("draft_model", "random", True), ("eagle", "random", False), ("eagle", "random", True),
])
def test_greedy_outputs_equal_the_engine_without_speculation(proposer, target, stress,
                                                            model_dir, succ_dir, draft_dir,
                                                            eagle_dir, references):
    target_dir = succ_dir if target == "succ" else model_dir
    spec = _spec(proposer, target_dir, draft_dir, eagle_dir, 3)
    llm = checked(make_llm(target_dir, speculative=spec, **(STRESS if stress else {})))
    assert_same(generate(llm, PROMPTS, GREEDY), references[target])
    if stress:  # again: the shared prompts now hit the prefix cache
        assert_same(generate(llm, PROMPTS, GREEDY), references[target])
        stats = llm.engine.stats()
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    s = llm.engine.stats().spec_decode
    assert s.num_drafts > 0
    if proposer == "draft_self":  # every draft is the target's own choice: the bonus path
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert s.mean_acceptance_length == pytest.approx(1 + s.num_draft_tokens / s.num_drafts)
    elif target == "succ":  # copies: accepted where the prompt's run goes on, not after it
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens
        assert s.acceptance_rate > 0.5


@pytest.mark.parametrize("proposer", ["ngram", "draft_self"])
def test_greedy_on_the_torch_attention_backend(proposer, model_dir, succ_dir, references):
    """Verify rows (1 + K query tokens over a context) on the torch backend's path for
    chunked prefills (the cpu backend runs them as one decode row per token)."""
    target = "succ" if proposer == "ngram" else "random"
    target_dir = succ_dir if target == "succ" else model_dir
    llm = checked(make_llm(target_dir, speculative=_spec(proposer, target_dir, None, None, 3),
                           attention={"name": "torch"}))
    assert_same(generate(llm, PROMPTS, GREEDY), references[target])
    s = llm.engine.stats().spec_decode
    assert s.num_accepted_tokens > 0


def test_a_draft_wrong_at_known_positions(model_dir, references):
    """The target as its own draft, its drafts made wrong at known output positions: the
    tokens stay the target's; every proposal is accepted up to its first wrong draft."""
    wrong_at = {3, 4, 10, 17}
    llm = make_llm(model_dir, speculative={"name": "draft_model", "num_speculative_tokens": 3,
                                           "model": str(model_dir)})
    proposer = llm.engine.executor.runner.proposer
    propose = proposer.propose
    expected = []

    def corrupt(batch, rows, step=None):
        out = propose(batch, rows, step)
        for rid, drafts in out.items():
            row = batch.req_id_to_row[rid]
            done = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            room = MAX_TOKENS - done - 1  # drafts past max_tokens are not scheduled
            for j in range(len(drafts)):
                if done + j in wrong_at:
                    drafts[j] = (drafts[j] + 1) % 640
            kept = drafts[:max(room, 0)]
            first_wrong = next((j for j in range(len(kept)) if done + j in wrong_at), len(kept))
            if kept:
                expected.append(first_wrong)
        return out
    proposer.propose = corrupt
    assert_same(generate(llm, PROMPTS, GREEDY), references["random"])
    s = llm.engine.stats().spec_decode
    assert s.num_drafts == len(expected)
    assert s.num_accepted_tokens == sum(expected) < s.num_draft_tokens


# -- the draft's own KV: drafts equal from-scratch references -------------------------------
def test_draft_model_drafts_are_its_greedy_continuation(model_dir, draft_dir):
    """Under preemption, chunked prefill and prefix hits, every proposal equals the draft
    model's own greedy continuation computed from scratch by transformers."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(model_dir, speculative={"name": "draft_model", "num_speculative_tokens": 3,
                                           "model": str(draft_dir)}, **STRESS)
    rec = Recorder(llm.engine.executor.runner.proposer)
    generate(llm, PROMPTS, GREEDY)
    generate(llm, PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions_total > 0
    hf = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    assert len(rec.records) > 20
    with torch.no_grad():
        for tokens, drafts in rec.records[::max(1, len(rec.records) // 12)]:
            out = hf.generate(torch.tensor([tokens]), max_new_tokens=len(drafts),
                              do_sample=False, pad_token_id=0)
            assert out[0, len(tokens):].tolist() == drafts


def _eagle_reference(target, head_dir, tokens: list[int], k: int) -> list[int]:
    """EAGLE-1's drafts computed without any cache: the target's features at every position,
    the head (transformers' Llama layer without input norm, fc, the target's embedding and LM
    head) run causally over the whole sequence for each draft."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(str(head_dir))
    config._attn_implementation = "eager"
    weights = load_file(str(head_dir / "model.safetensors"))
    layer = LlamaDecoderLayer(config, 0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items()
                           if k.startswith("layers.0.")})
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
    fc.load_state_dict({"weight": weights["fc.weight"], "bias": weights["fc.bias"]})
    rotary = LlamaRotaryEmbedding(config)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    ids = torch.tensor([tokens])
    feats = target(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    inputs = [fc(torch.cat([embed(ids[0, p + 1]), feats[p]])) for p in range(len(tokens) - 1)]
    drafts = []
    for _ in range(k):
        x = torch.stack(inputs)[None]
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pos = torch.arange(n)[None]
        out = layer(x, attention_mask=mask, position_ids=pos,
                    position_embeddings=rotary(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        feature = out[0, -1]  # transformers' layer output includes both residual adds
        tok = int(lm_head(feature).argmax())
        drafts.append(tok)
        inputs.append(fc(torch.cat([embed(torch.tensor(tok)), feature])))
    return drafts


def test_eagle_drafts_equal_a_from_scratch_head(model_dir, eagle_dir):
    from transformers import AutoModelForCausalLM

    llm = make_llm(model_dir, speculative={"name": "eagle", "num_speculative_tokens": 3,
                                           "model": str(eagle_dir)}, **STRESS)
    rec = Recorder(llm.engine.executor.runner.proposer)
    generate(llm, PROMPTS, GREEDY)
    generate(llm, PROMPTS, GREEDY)  # prefix hits: the last hit block is recomputed for EAGLE
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert len(rec.records) > 20
    with torch.no_grad():
        for tokens, drafts in rec.records[::max(1, len(rec.records) // 12)]:
            assert _eagle_reference(target, eagle_dir, list(tokens), len(drafts)) == drafts


# -- the sampled distribution is the target's -----------------------------------------------
DIST_PROMPT = [5, 9, 33, 2, 71, 8]
# max_tokens 3: a draft for the second token is scheduled only when a third may follow it
DIST = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
NUM_SAMPLES = 2000
ALPHA = 0.01 / 2  # family-wise 1% over the two proposers' tests (Bonferroni)


@pytest.fixture(scope="module")
def exact_first_two(model_dir):
    """P(t1, t2 | DIST_PROMPT) of the target after temperature and top-k, exactly."""
    from transformers import AutoModelForCausalLM

    from llmkit.sampling.sampler import TorchSampler

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def dist(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        return TorchSampler.filtered_probs(logits[None] / DIST["temperature"],
                                           torch.tensor([DIST["top_k"]]))[0]
    p1 = dist(DIST_PROMPT)
    joint = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(DIST_PROMPT + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


class FixedProposer(Proposer):
    """Proposes the same tokens for every row: a one-hot q, like n-gram drafts."""
    num_speculative_tokens = 2

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, batch, rows, step=None):
        return {batch.req_ids[r]: list(self.tokens) for r in rows.tolist()}


def _chi_square_p(samples: list[tuple[int, int]], exact: dict) -> float:
    from scipy.stats import chisquare

    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(exact), "a pair the target can never produce"
    n = len(samples)
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * n >= 5]
    small = [c for c in cells if exact[c] * n < 5]  # merged into one cell
    obs = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)]
                                             if small else [])
    exp = [exact[c] * n for c in big] + ([sum(exact[c] for c in small) * n] if small else [])
    return float(chisquare(obs, np.asarray(exp) * (n / sum(exp))).pvalue)


def _first_two(llm) -> list[tuple[int, int]]:
    outs = llm.generate([DIST_PROMPT] * NUM_SAMPLES, SamplingParams(**DIST), use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[:2]) for o in outs]


@pytest.mark.parametrize("proposer", ["one_hot", "draft_model"])
def test_sampled_distribution_is_the_targets(proposer, model_dir, near_draft_dir,
                                             exact_first_two, monkeypatch):
    """The first two generated tokens (the second verified against drafts) follow the target's
    exact joint distribution; a broken acceptance rule fails the same test."""
    import llmkit.sampling.rejection as rejection

    if proposer == "one_hot":
        llm = make_llm(model_dir, overrides=["seed=1"])
        # drafts the target often accepts: its likeliest second token after its likeliest first
        (t1, t2) = max(exact_first_two, key=exact_first_two.get)
        llm.engine.executor.runner.proposer = FixedProposer([t2, t1])
        llm.engine._speculative = True
    else:
        llm = make_llm(model_dir, overrides=["seed=1"], speculative={
            "name": "draft_model", "num_speculative_tokens": 2, "model": str(near_draft_dir)})
    samples = _first_two(llm)
    s = llm.engine.stats().spec_decode
    assert s.num_drafts >= NUM_SAMPLES * 0.9 and 0 < s.num_accepted_tokens
    assert _chi_square_p(samples, exact_first_two) > ALPHA
    # accept with p(x) alone (q ignored) / always: the distribution is no longer the target's
    broken = (lambda u, p, q: u < p) if proposer == "draft_model" else \
        (lambda u, p, q: u < torch.clamp(2 * p, max=1.0))
    monkeypatch.setattr(rejection, "accept", broken)
    assert _chi_square_p(_first_two(llm), exact_first_two) < ALPHA


# -- stops, penalties, seeds, n > 1 ---------------------------------------------------------
def test_stops_inside_an_accepted_run(model_dir, references):
    ref = references["random"][0].outputs[0].token_ids
    stop = ref[6]
    llm = make_llm(model_dir, speculative={"name": "draft_model", "num_speculative_tokens": 4,
                                           "model": str(model_dir)})
    tok = llm.get_tokenizer()
    out = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True, stop_token_ids=[stop]))
    assert out[0].outputs[0].token_ids == ref[:ref.index(stop) + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    # a stop string ends the text (and the request) inside the run
    text = tok.decode(ref)
    stop_text = tok.decode(ref[8:10])
    out = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True, stop=[stop_text]))
    assert out[0].outputs[0].text == text[:text.index(stop_text)]
    assert out[0].outputs[0].finish_reason == "stop"
    out = generate(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [
        r.outputs[0].token_ids[:7] for r in references["random"]]


def test_penalties_bias_and_min_tokens_apply_at_every_verified_position(model_dir):
    """The target as its own draft proposes its *unpenalised* choices: penalties, logit bias
    and min_tokens (a stop id banned until then) must be applied at each verified position with
    that position's history for the tokens to equal the engine's without speculation."""
    ref_tokens = generate(make_llm(model_dir), PROMPTS, GREEDY)
    stop = ref_tokens[1].outputs[0].token_ids[3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1,
                            repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3,
                            logit_bias={ref_tokens[0].outputs[0].token_ids[5]: 2.0},
                            min_tokens=8, stop_token_ids=[stop])
    want = generate(make_llm(model_dir), PROMPTS, params)
    llm = make_llm(model_dir, speculative={"name": "draft_model", "num_speculative_tokens": 3,
                                           "model": str(model_dir)})
    assert_same(generate(llm, PROMPTS, params), want)
    s = llm.engine.stats().spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # penalties made some drafts wrong


def test_seeds_reproduce_and_n_samples(model_dir, draft_dir):
    spec = {"name": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}
    seeded = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    llm = make_llm(model_dir, speculative=spec)
    alone = generate(llm, PROMPTS[1:2], seeded)[0].outputs[0].token_ids
    again = generate(llm, PROMPTS[1:2], seeded)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    in_batch = generate(llm, PROMPTS, [other, seeded, other, other, other])
    assert alone == again == in_batch[1].outputs[0].token_ids
    # n > 1: n seeded samples, and greedy samples are all the target's greedy output
    outs = generate(llm, PROMPTS[:2], SamplingParams(n=3, temperature=0.9, seed=3,
                                                     max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(len(o.outputs) == 3 for o in outs)
    greedy = generate(llm, PROMPTS[:1], SamplingParams(n=2, temperature=0.0,
                                                       max_tokens=MAX_TOKENS, ignore_eos=True))
    ref = generate(make_llm(model_dir), PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    assert [c.token_ids for c in greedy[0].outputs] == [ref, ref]


# -- adaptive K, disable_by_batch_size -------------------------------------------------------
def test_draft_length_policy():
    from llmkit.platforms.base import ridge_from_timings
    from llmkit.spec_decode.adaptive import DraftLengthPolicy

    p = DraftLengthPolicy(adaptive=True, ridge_tokens=32)
    assert [p.num_drafts(4, rows, rows) for rows in (1, 4, 8, 16, 17, 64)] == [4, 4, 3, 1, 0, 0]
    assert DraftLengthPolicy(disable_by_batch_size=8).num_drafts(4, 3, 8) == 0
    assert DraftLengthPolicy(disable_by_batch_size=8).num_drafts(4, 3, 7) == 4
    # a roofline t(n) = max(10, n / 2): the knee at 20 tokens
    assert ridge_from_timings({n: max(10.0, n / 2) for n in (1, 2, 4, 8, 16, 32, 64)}) == 20
    assert ridge_from_timings({1: 1.0, 2: 1.0, 4: 1.0}) == 4  # never rises: the largest


def test_adaptive_and_disable_by_batch_size_cut_drafts(succ_dir, references):
    base = {"name": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    counts = {}
    for name, extra in (("fixed", {}), ("adaptive", {"adaptive": True, "ridge_tokens": 10}),
                        ("disabled", {"disable_by_batch_size": 2})):
        llm = make_llm(succ_dir, speculative={**base, **extra})
        assert_same(generate(llm, PROMPTS, GREEDY), references["succ"])
        counts[name] = llm.engine.stats().spec_decode.num_draft_tokens
        if name == "adaptive":  # 5 rows: 10 // 5 - 1 = 1 draft each at most
            assert counts[name] <= MAX_TOKENS * len(PROMPTS)
    assert counts["fixed"] > counts["adaptive"] > 0
    assert counts["disabled"] == 0  # five requests run together from the first step to the last
    # measured at start-up when not given: the step costs by rows, and the expected-throughput
    # rule fed by the verified rows
    llm = make_llm(succ_dir, speculative={**base, "adaptive": True})
    policy = llm.engine.executor.runner.proposer.length_policy
    assert policy.ridge_tokens >= 1 and policy.step_costs is not None
    assert set(range(1, 6)) <= set(policy.step_costs.counts.astype(int).tolist())
    # What K the measured costs pick depends on this machine and its load (a busy one can make
    # every draft look unprofitable); the plumbing below must not: flat costs (memory-bound)
    # make drafting pay, so the verified rows must reach the estimate.
    from llmkit.spec_decode.adaptive import StepCosts
    policy.step_costs = StepCosts({n: 1.0 for n in range(1, 33)})
    assert_same(generate(llm, PROMPTS, GREEDY), references["succ"])
    # the verified rows reached the estimate (it left its prior of 2 rows at 0.7 per position)
    assert policy.acceptance is not None and not np.allclose(policy.acceptance.tried, 2.0)
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_expected_throughput_rule():
    from llmkit.spec_decode.adaptive import AcceptanceEstimate, DraftLengthPolicy, StepCosts

    costs = StepCosts({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0})
    assert costs(3) == 12.0 and costs(16) == 25.0  # linear between, the last slope past
    est = AcceptanceEstimate(3, prior_weight=1e-6)
    # rows with 3 drafts: two accept all, one accepts 1, one none
    est.observe(np.array([3, 3, 3, 3]), np.array([3, 3, 1, 0]))
    rates = est.rates()
    assert rates[0] == pytest.approx(3 / 4, rel=0.05)  # 3 of the 4 accepted draft 1
    assert rates[1] == pytest.approx(2 / 3, rel=0.05) and rates[2] == pytest.approx(1, rel=0.05)
    assert est.expected_tokens()[0] == 1.0

    def policy(step_costs, rate):
        p = DraftLengthPolicy(adaptive=True, step_costs=StepCosts(step_costs))
        p.acceptance = AcceptanceEstimate(5, prior=rate, prior_weight=1e3)
        return p
    # memory-bound (every row free): the most drafts; compute-bound (cost per token): none
    assert policy({1: 1.0, 512: 1.0}, 0.5).num_drafts(5, 1, 1) == 5
    assert policy({1: 1.0, 2: 2.0}, 0.9).num_drafts(5, 8, 8) == 0
    # each row a quarter of a one-row step: long accepted runs pay for K, short ones do not
    quarter = {1: 1.0, 2: 1.25, 8: 2.75}
    assert policy(quarter, 0.95).num_drafts(5, 1, 1) == 5
    assert 1 <= policy(quarter, 0.6).num_drafts(5, 1, 1) <= 3
    assert policy(quarter, 0.1).num_drafts(5, 1, 1) == 0
    # disable_by_batch_size still wins
    p = policy({1: 1.0, 512: 1.0}, 0.9)
    p.disable_by_batch_size = 4
    assert p.num_drafts(5, 4, 4) == 0


# -- configuration ---------------------------------------------------------------------------
def test_config_errors_name_the_key(model_dir, tiny_model_dir, tmp_path):
    other_vocab = tiny_model_dir("llama", vocab_size=700)
    with pytest.raises(ConfigError, match=r"speculative\.model.*vocabulary has 700"):
        make_llm(model_dir, speculative={"name": "draft_model", "num_speculative_tokens": 2,
                                         "model": str(other_vocab)})
    with pytest.raises(ConfigError, match=r"speculative\.model"):
        make_llm(model_dir, speculative={"name": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative\.model.*EAGLE head"):
        make_llm(model_dir, speculative={"name": "eagle", "num_speculative_tokens": 2,
                                         "model": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"speculative\.num_speculative_tokens"):
        make_llm(model_dir, speculative="ngram", overrides=["speculative.num_speculative_tokens=0"])
    with pytest.raises(ConfigError, match=r"speculative\.name.*ngram"):
        make_llm(model_dir, speculative={"name": "medusa", "num_speculative_tokens": 2})
    # a scheduler that cannot schedule drafts: refused at start-up, not at the first draft
    with pytest.raises(ConfigError, match=r"speculative\.name: .*NoDraftScheduler"):
        make_llm(model_dir, speculative={"name": "ngram", "num_speculative_tokens": 2},
                 scheduler={"_target_": "test_spec_decode.NoDraftScheduler"})


class RepeatLastProposer(Proposer):
    """A proposer from a class path (``speculative._target_``): K copies of the last token."""

    def __init__(self, k: int) -> None:
        self.num_speculative_tokens = k

    @classmethod
    def from_config(cls, config, env):
        return cls(config.num_speculative_tokens)

    def propose(self, batch, rows, step=None):
        k = self.num_drafts(len(rows), batch.num_reqs)
        return {batch.req_ids[r]: [int(batch.token_ids[r, batch.num_tokens[r] - 1])] * k
                for r in rows.tolist()}


def test_a_proposer_from_a_class_path(model_dir, references):
    llm = make_llm(model_dir, speculative={"_target_": "test_spec_decode.RepeatLastProposer",
                                           "num_speculative_tokens": 2})
    assert_same(generate(llm, PROMPTS, GREEDY), references["random"])
    assert llm.engine.stats().spec_decode.num_drafts > 0
    with pytest.raises(ConfigError, match=r"speculative\.num_speculative_tokens"):
        make_llm(model_dir, speculative={"_target_": "test_spec_decode.RepeatLastProposer"})


class NoDraftScheduler(TokenBudgetScheduler):
    update_draft_token_ids = Scheduler.update_draft_token_ids


def test_prometheus_names():
    from llmkit.entrypoints.openai.metrics import ServerMetrics
    from llmkit.scheduler.base import SchedulerStats, SpecDecodeStats

    m = ServerMetrics("m")
    m.on_scheduler_stats(SchedulerStats(1, 0, 0.1, 0, 0, 0,
                                        spec_decode=SpecDecodeStats(3, 9, 5, [3, 2, 0])))
    text = m.render().decode()
    for line in ('llmkit:spec_decode_num_drafts_total{model_name="m"} 3.0',
                 'llmkit:spec_decode_num_draft_tokens_total{model_name="m"} 9.0',
                 'llmkit:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0',
                 'llmkit:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
                 'position="1"} 2.0'):
        assert line in text


# -- the simulator reads the same group --------------------------------------------------------
def test_sim_speculation_with_an_acceptance_model():
    from llmkit.tools.compose import compose_tool_config
    from llmkit.tools.schema import SimToolConfig
    from llmkit.tools.sim.replay import run_sim

    def compose_config(overrides):
        return compose_tool_config(SimToolConfig, overrides)

    common = ["sim.model=llama-2-7b", "hardware=a100-80gb", "bench.num_requests=16",
              "bench.input_len=64", "bench.output_len=32", "bench.max_concurrency=1",
              "bench.progress=false"]
    none = run_sim(compose_config(common))
    spec = run_sim(compose_config(common + ["speculative=ngram",
                                            "speculative.num_speculative_tokens=3",
                                            "speculative.acceptance_rates=[1.0]"]))
    block = spec["sim"]["spec_decode"]
    # every draft accepted: 4 tokens a verify step (fewer only where max_tokens cuts a run)
    assert block["acceptance_rate"] == 1.0 and block["mean_acceptance_length"] > 3.5
    ratio = spec["summary"]["output_throughput"] / none["summary"]["output_throughput"]
    assert ratio > 2.5  # batch 1 on an A100: verifying 4 tokens costs about what 1 does
    # past the ridge, adaptive drafts nothing
    wide = [c.replace("max_concurrency=1", "max_concurrency=16") for c in common]
    adaptive = run_sim(compose_config(wide + ["speculative=ngram", "speculative.adaptive=true",
                                              "speculative.ridge_tokens=16"]))
    assert adaptive["sim"]["spec_decode"]["num_draft_tokens"] == 0


@pytest.mark.slow
def test_verify_steps_run_through_the_decode_graph(succ_dir, monkeypatch):
    """compilation.mode=graphs: a verify step of decoding rows that fits a step graph runs
    through it (one block-table row and length per token) and computes exactly what the eager
    verify step computes."""
    from llmkit.compilation.inductor import InductorStepGraphs

    tokens = {"graph": 0}
    run = InductorStepGraphs.run

    def counting_run(self, input_ids, *args):
        tokens["graph"] += int(input_ids.shape[0])
        return run(self, input_ids, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    spec = {"name": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompts = PROMPTS[:2]  # verify steps of up to 2 x (1 + 3) = 8 tokens
    eager = generate(make_llm(succ_dir, speculative=spec, compilation={"mode": "eager"}),
                     prompts, GREEDY)
    assert tokens["graph"] == 0
    llm = make_llm(succ_dir, speculative=spec, compilation={"mode": "graphs"})
    graph = generate(llm, prompts, GREEDY)
    s = llm.engine.stats().spec_decode
    # every generated token but the prompts' first came out of a graph step
    assert tokens["graph"] >= 2 * (MAX_TOKENS - 1) - s.num_draft_tokens + 2 * s.num_drafts
    assert_same(graph, eager, tol=0.0)


# -- structured output: drafts checked against the grammar ----------------------------------
def test_structured_output_greedy_equals_the_engine_without_speculation(model_dir):
    """Constrained greedy requests (a JSON schema, a regex, a choice), batched with
    unconstrained ones: the same tokens with the target as its own draft (every draft the
    target's unconstrained choice, so the grammar refuses some: a draft-row bitmask and a
    matcher rollback per step) and with n-gram drafts as without speculation."""
    from llmkit import StructuredOutputsParams

    specs = [StructuredOutputsParams(json={"type": "object", "properties": {
                 "name": {"type": "string", "maxLength": 6},
                 "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "n"]}),
             StructuredOutputsParams(regex=r"[a-c]{2,6}-\d{2,4}"),
             StructuredOutputsParams(choice=["red", "green", "blue", "dark green"]), None]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1,
                             structured_outputs=s) for s in specs]
    prompts = PROMPTS[:4]
    groups = {"structured_output": {"disable_any_whitespace": True}}
    want = generate(make_llm(model_dir, **groups), prompts, params)
    for spec in ({"name": "draft_model", "num_speculative_tokens": 3, "model": str(model_dir)},
                 {"name": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = checked(make_llm(model_dir, speculative=spec, **groups))
        assert_same(generate(llm, prompts, params), want)
        s = llm.engine.stats().spec_decode
        assert s.num_drafts > 0
        if spec["name"] == "draft_model":  # the grammar made some of the drafts wrong
            assert 0 < s.num_accepted_tokens < s.num_draft_tokens


# -- the server: the same tokens, and the counters on /metrics ------------------------------
def test_server_speculates_and_exports_the_counters(succ_dir, references, tmp_path):
    """``llmkit serve speculative=ngram``: completions (token-id prompts, greedy) equal the
    offline engine's without speculation; /metrics counts the drafts the engine verified."""
    from helpers.server_process import ServerProcess

    server = ServerProcess(succ_dir, "speculative=ngram", "speculative.num_speculative_tokens=3",
                           "speculative.prompt_lookup_min=1", "platform.num_threads=1",
                           log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        client = server.client()
        model = client.models.list().data[0].id
        for prompt, ref in zip(PROMPTS[:2], references["succ"][:2]):
            resp = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})
            assert resp.choices[0].text == ref.outputs[0].text
            assert resp.usage.completion_tokens == MAX_TOKENS
        m = server.metrics()
        drafts = m["llmkit:spec_decode_num_drafts_total"]
        proposed = m["llmkit:spec_decode_num_draft_tokens_total"]
        accepted = m["llmkit:spec_decode_num_accepted_tokens_total"]
        assert 0 < drafts and 0 < accepted < proposed <= 3 * drafts
        per_pos = [m[f'llmkit:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model}"'
                     f',position="{j}"}}'] for j in range(3)]
        assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    finally:
        server.stop()


# -- bench and the step trace report the speculation -----------------------------------------
def test_bench_and_step_trace_report_speculation(model_dir, succ_dir, tmp_path, capsys):
    """bench throughput|latency with the target as its own draft (every draft accepted) print
    and record the counters; the step trace's per-step counts add up to the engine's."""
    import json
    from pathlib import Path

    from llmkit.engine.observe.step_trace import StepTrace
    from llmkit.entrypoints import cli

    data = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "copy_prompts.jsonl"
    spec = ["speculative=draft_model", "speculative.num_speculative_tokens=3",
            f"speculative.model={model_dir}"]
    common = [str(model_dir), "model.dtype=float32", "bench.dataset=jsonl",
              f"bench.dataset_path={data}", "bench.output_len=12", "bench.progress=false",
              f"bench.output_dir={tmp_path}", *spec]
    assert cli.main(["bench", "throughput", *common, "bench.num_requests=4",
                     "bench.result_name=tp"]) == 0
    assert "speculative:" in capsys.readouterr().out
    s = json.loads((tmp_path / "tp.json").read_text())["summary"]["spec_decode"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] == s["num_draft_tokens"]
    assert sum(s["accepted_per_position"]) == s["num_accepted_tokens"]
    assert s["acceptance_rate"] == 1.0
    assert s["mean_acceptance_length"] == pytest.approx(
        1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert cli.main(["bench", "latency", *common, "bench.batch_size=2", "bench.num_iters=1",
                     "bench.num_iters_warmup=0", "bench.result_name=lat"]) == 0
    assert "speculative " in capsys.readouterr().out
    doc = json.loads((tmp_path / "lat.json").read_text())
    s = doc["summary"]["spec_decode"]
    assert s["num_drafts"] == sum(st["spec_drafts"] for st in doc["steps"]) > 0
    assert s["num_accepted_tokens"] == sum(st["spec_accepted_tokens"] for st in doc["steps"])
    # the step trace file: per-step counts that add up to the engine's totals
    llm = make_llm(succ_dir, speculative=_spec("ngram", None, None, None, 3),
                   overrides=[f"observability.trace_file={tmp_path / 'trace.json'}"])
    generate(llm, PROMPTS, GREEDY)
    (trace,) = [o for o in llm.engine.step_observers if isinstance(o, StepTrace)]
    total = llm.engine.stats().spec_decode
    assert sum(st.spec_drafts for st in trace.steps) == total.num_drafts > 0
    assert sum(st.spec_draft_tokens for st in trace.steps) == total.num_draft_tokens
    assert sum(st.spec_accepted_tokens for st in trace.steps) == total.num_accepted_tokens
    llm.shutdown()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e["name"] == "speculative" and e["ph"] == "C" for e in events)
