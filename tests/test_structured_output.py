"""Structured output (issue 19): the xgrammar backend and the manager alone (compile in the
background, cache, bitmask rows, accept, rollback), the scheduler's WAITING_FOR_FSM, and the
offline engine on a tiny random Llama: outputs of JSON schemas, regexes, choices and an EBNF
grammar are valid (an output cut by ``max_tokens`` is a valid prefix), batched with
unconstrained requests whose greedy outputs they do not change.

Constrained greedy with and without speculative decoding (drafts checked against the grammar)
is tested in ``test_spec_decode.py``; the manager's draft rows and rollback are tested here.
"""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from llmkit import LLM, SamplingParams, StructuredOutputsParams
from llmkit.config.schema import SchedulerConfig, StructuredOutputConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.scheduler import TokenBudgetScheduler
from llmkit.structured_output import GrammarCompileError, StructuredOutputKind
from llmkit.structured_output.bitmask import unpack_bitmask
from llmkit.structured_output.manager import StructuredOutputManager
from llmkit.structured_output.xgrammar_backend import XgrammarBackend

EOS = 2  # the tiny tokenizer's <|im_end|>

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                            {"type": "string", "pattern": "^[a-z]{2,4}$"},
                            {"type": "null"}]}}, "required": ["value"]},
    "numbers": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1},
        "n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
        "required": ["x", "n"]},
    "optional": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
        "note": {"type": "string", "maxLength": 5},
        "count": {"type": "integer", "minimum": 1}},
        "required": ["id"], "additionalProperties": False},
}
PROMPTS = ["Hello, how are you", "The capital of France is", "Write some JSON:"]
# A small EBNF grammar: sums and products of numbers, with parentheses.
ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""


def arith_parses(text: str) -> bool:
    """A recursive-descent parser of ARITH's language."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[0-9]{1,3}", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def backend(tiny_tokenizer):
    return XgrammarBackend(tokenizer=tiny_tokenizer, vocab_size=len(tiny_tokenizer))


def is_valid_prefix(backend: XgrammarBackend, params: StructuredOutputsParams,
                    token_ids: list[int]) -> bool:
    """xgrammar's own check that ``token_ids`` can start an output of ``params``."""
    from llmkit.structured_output import structured_output_key

    matcher = xgr.GrammarMatcher(backend.compile(structured_output_key(params)))
    return all(matcher.accept_token(t) for t in token_ids)


def check_output(backend, params: StructuredOutputsParams, out, schema=None) -> bool:
    """A finished output is valid (JSON of its schema, etc.); one cut by max_tokens is a valid
    prefix. Returns whether it finished."""
    c = out.outputs[0]
    if c.finish_reason == "length":
        assert is_valid_prefix(backend, params, c.token_ids), (c.text, c.token_ids)
        return False
    assert c.finish_reason == "stop", (c.finish_reason, c.stop_reason)
    assert c.token_ids[-1] == EOS  # EOS taken by the grammar's end (or sampled)
    if schema is not None:
        jsonschema.validate(json.loads(c.text), schema)
    elif params.json_object:
        assert isinstance(json.loads(c.text), dict)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, c.text), c.text
    elif params.choice is not None:
        assert c.text in params.choice
    return True


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    """The default config (JSON may hold any whitespace)."""
    return LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 512},
               platform={"num_threads": 1})


@pytest.fixture(scope="module")
def llm_compact(model_dir):
    """JSON without free whitespace (a random model otherwise spends its tokens on it)."""
    return LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 512},
               platform={"num_threads": 1},
               structured_output={"disable_any_whitespace": True})


# --------------------------------------------------------------------------- backend alone

@pytest.mark.parametrize("params,match", [
    (StructuredOutputsParams(json='{"type": "object",'), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
     r"'uniqueItems' at \$\.uniqueItems"),
    (StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 3}}}), r"'multipleOf' at \$\.properties\.n"),
    (StructuredOutputsParams(json={"type": "string", "format": "colour"}), "'format': 'colour'"),
    (StructuredOutputsParams(json={"type": "strin"}), 'Unsupported type "strin"'),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 2}),
     "minimum greater than maximum"),
    (StructuredOutputsParams(regex="[a-z"), r"structured_outputs\.regex: .*Unclosed '\['"),
    (StructuredOutputsParams(grammar='rot ::= "a"'), "root rule"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"),
     'Rule "undefined_rule" is not defined'),
])
def test_bad_specs_are_refused_with_what_is_wrong(params, match):
    with pytest.raises(GrammarCompileError, match=match):
        XgrammarBackend.validate(params)


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_length_bounded_strings_stay_valid_json(backend):
    """xgrammar alone lets raw control characters into a maxLength string; ours does not."""
    key = (StructuredOutputKind.JSON, json.dumps({"type": "string", "maxLength": 3}))

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(backend.compile(key))
        return m.accept_string(text) and m.is_completed()

    assert accepts('"abc"') and not accepts('"abcd"')
    assert not accepts('"a\x11"') and not accepts('"a\nb"')


def test_unpack_bitmask_layout():
    bm = np.zeros((2, 3), dtype=np.int32)
    bm[0, 0] = 1 << 5  # token 5
    bm[0, 2] = np.uint32(1 << 31).view(np.int32)  # token 95
    bm[1, :] = -1
    dense = unpack_bitmask(bm, 70)
    assert dense.shape == (2, 70)
    assert np.flatnonzero(dense[0]).tolist() == [5]  # token 95 is past the vocabulary
    assert dense[1].all()
    assert np.flatnonzero(unpack_bitmask(bm, 96)[0]).tolist() == [5, 95]


# --------------------------------------------------------------------------- manager alone

def make_manager(tokenizer, **config) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputConfig(**config),
                                   vocab_size=len(tokenizer), tokenizer_loader=lambda: tokenizer,
                                   max_rollback_tokens=8)


def constrained(rid: str, so: StructuredOutputsParams, **kw) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(structured_outputs=so, **kw),
                   eos_token_id=EOS)


def ready(mgr: StructuredOutputManager, *reqs: Request) -> None:
    for r in reqs:
        mgr.grammar_init(r)
    left = list(reqs)
    for _ in range(500):
        _, failed, left = mgr.take_ready(left, wait=True, timeout=0.05)
        assert not failed, [r.structured_output_request.error for r in failed]
        if not left:
            return
    raise AssertionError("grammars did not compile")


def allowed_tokens(bitmask_row: np.ndarray, vocab: int) -> set[int]:
    return set(np.flatnonzero(unpack_bitmask(bitmask_row, vocab)[0]).tolist())


def scheduled(req: Request) -> Request:
    """As the scheduler leaves it for grammar_bitmask: its tokens count as computed."""
    req.num_computed_tokens = req.num_tokens
    return req


def test_manager_shares_one_compilation_per_spec(tiny_tokenizer):
    mgr = make_manager(tiny_tokenizer, cache_size=2)
    so = StructuredOutputsParams(json=SCHEMAS["nested"])
    a, b = constrained("a", so), constrained("b", StructuredOutputsParams(json=SCHEMAS["nested"]))
    ready(mgr, a, b)
    assert a.structured_output_request.compiled is b.structured_output_request.compiled
    assert len(mgr.compile_times) == 1
    assert a.structured_output_request.grammar is not b.structured_output_request.grammar
    # LRU of two specs: a third evicts the first, which then compiles again
    ready(mgr, constrained("c", StructuredOutputsParams(regex="x+")),
          constrained("d", StructuredOutputsParams(regex="y+")))
    e = constrained("e", so)
    ready(mgr, e)
    assert e.structured_output_request.compiled is not a.structured_output_request.compiled
    mgr.shutdown()


def test_manager_bitmask_accept_rollback_and_draft_rows(tiny_tokenizer):
    tok, vocab = tiny_tokenizer, len(tiny_tokenizer)
    mgr = make_manager(tok)
    plain = Request("p", [5, 6], SamplingParams())
    r = constrained("r", StructuredOutputsParams(json={
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    ready(mgr, r)
    requests = {"p": scheduled(plain), "r": scheduled(r)}
    ids, bm0 = mgr.grammar_bitmask(requests, ["p", "r"])
    assert ids == ["r"] and bm0.shape == (1, (vocab + 31) // 32) and bm0.dtype == np.int32
    assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed_tokens(bm0, vocab))
    text = '{"a": 12'
    toks = tok.encode(text)
    snapshots = []
    for t in toks:
        snapshots.append(mgr.grammar_bitmask(requests, ["r"])[1].copy())
        assert mgr.accept_tokens(r, [t])
    assert not mgr.accept_tokens(r, [tok.encode("x")[0]])  # refused, state unchanged
    after = mgr.grammar_bitmask(requests, ["r"])[1].copy()
    # roll back N tokens: the bitmask is what it was N tokens ago
    for n in (1, 3):
        mgr.rollback(r, n)
        assert np.array_equal(mgr.grammar_bitmask(requests, ["r"])[1], snapshots[len(toks) - n])
        assert mgr.accept_tokens(r, toks[len(toks) - n:])
    assert np.array_equal(mgr.grammar_bitmask(requests, ["r"])[1], after)
    # draft tokens: one row per position, each after the drafts before it; state unchanged
    mgr.rollback(r, 3)
    drafts = toks[-3:]
    ids, rows = mgr.grammar_bitmask(requests, ["p", "r"], {"r": drafts})
    assert ids == ["r"] and rows.shape[0] == 4
    assert np.array_equal(rows[0], snapshots[-3][0]) and np.array_equal(rows[3], after[0])
    assert r.structured_output_request.grammar.num_processed_tokens == len(toks) - 3
    assert np.array_equal(mgr.grammar_bitmask(requests, ["r"])[1][0], snapshots[-3][0])
    # a draft the grammar refuses: its row refuses it, rows after it are unconstrained
    bad = tok.encode("x")[0]
    ids, rows = mgr.grammar_bitmask(requests, ["r"], {"r": [drafts[0], bad, drafts[2]]})
    assert bad not in allowed_tokens(rows[1], vocab) and (rows[2:] == -1).all()
    mgr.shutdown()


def test_manager_terminates_when_only_eos_may_follow(tiny_tokenizer):
    mgr = make_manager(tiny_tokenizer)
    r = constrained("r", StructuredOutputsParams(choice=["yes", "no"]))
    with_lp = constrained("l", StructuredOutputsParams(choice=["yes", "no"]), logprobs=1)
    ready(mgr, r, with_lp)
    for req in (r, with_lp):
        for t in tiny_tokenizer.encode("yes"):
            req.append_output_token(t)
            assert mgr.accept_tokens(req, [t])
    assert mgr.should_terminate(r)
    assert not mgr.should_terminate(with_lp)  # its EOS would have no logprobs: it samples it
    mgr.shutdown()


def test_manager_reports_compile_failure_for_that_request(tiny_tokenizer, monkeypatch):
    mgr = make_manager(tiny_tokenizer)
    real = XgrammarBackend.compile

    def compile_or_fail(self, key):
        if key[1] == "fails+":
            raise GrammarCompileError("structured_outputs.regex: cannot compile: boom")
        return real(self, key)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_or_fail)
    bad, good = (constrained("bad", StructuredOutputsParams(regex="fails+")),
                 constrained("good", StructuredOutputsParams(regex="a+")))
    mgr.grammar_init(bad)
    mgr.grammar_init(good)
    failed, left = [], [bad, good]
    for _ in range(500):
        _, f, left = mgr.take_ready(left, wait=True, timeout=0.05)
        failed += f
        if not left:
            break
    assert failed == [bad] and "boom" in bad.structured_output_request.error
    assert good.structured_output_request.grammar is not None
    mgr.shutdown()


def test_scheduler_holds_request_until_grammar_compiles(tiny_tokenizer, monkeypatch):
    """WAITING_FOR_FSM: other requests are scheduled meanwhile; no step waits."""
    gate = threading.Event()
    real = XgrammarBackend.compile
    monkeypatch.setattr(XgrammarBackend, "compile",
                        lambda self, key: (gate.wait(10), real(self, key))[1])
    mgr = make_manager(tiny_tokenizer)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = TokenBudgetScheduler(SchedulerConfig(), kv, max_model_len=128, eos_token_id=EOS,
                                 structured_output_manager=mgr)
    a = Request("a", [5, 6, 7], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    b = Request("b", [8, 9], SamplingParams(max_tokens=8))
    sched.add_request(a)
    sched.add_request(b)
    assert a.status == RequestStatus.WAITING_FOR_FSM
    for _ in range(3):
        out = sched.schedule()
        assert list(out.num_scheduled_tokens) == ["b"] and out.grammar_bitmask is None
        sched.update_from_output(out, ModelRunnerOutput(req_ids=["b"],
                                                        sampled_token_ids=[[10]]))
    assert sched.stats().num_waiting == 1
    gate.set()
    for _ in range(200):
        out = sched.schedule()
        if "a" in out.num_scheduled_tokens:
            break
        sched.update_from_output(out, ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens),
                                                        sampled_token_ids=[[10]] * len(
                                                            out.num_scheduled_tokens)))
    assert out.structured_output_request_ids == ["a"] and out.grammar_bitmask.shape[0] == 1
    allowed = allowed_tokens(out.grammar_bitmask, len(tiny_tokenizer))
    assert {tiny_tokenizer.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    # "yes" in one token (if the vocabulary has it) or the first piece: the request goes on
    yes = tiny_tokenizer.encode("yes")
    rows = list(out.num_scheduled_tokens)
    res = sched.update_from_output(out, ModelRunnerOutput(
        req_ids=rows, sampled_token_ids=[[yes[0]] if r == "a" else [10] for r in rows]))
    for t in yes[1:]:
        out = sched.schedule()
        res = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=list(out.num_scheduled_tokens),
            sampled_token_ids=[[t] if r == "a" else [10] for r in out.num_scheduled_tokens]))
    # complete, only EOS may follow: it ends now, with EOS, without another step
    fin = next(o for o in res if o.request_id == "a")
    assert fin.finish_reason == "stop" and fin.new_token_ids[-1] == EOS
    assert a.output_token_ids == yes + [EOS]
    mgr.shutdown()


# --------------------------------------------------------------------------- engine (tiny Llama)

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_batched_with_unconstrained(llm_compact, backend,
                                                                 temperature):
    params, schemas, prompts = [], [], []
    for s, (name, schema) in enumerate(SCHEMAS.items()):
        for i, prompt in enumerate(PROMPTS):
            params.append(SamplingParams(temperature=temperature, seed=10 * s + i, max_tokens=80,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            schemas.append(schema)
            prompts.append(prompt)
    plain = [SamplingParams(temperature=temperature, seed=i, max_tokens=24) for i in range(3)]
    outs = llm_compact.generate(prompts + PROMPTS, params + plain, use_tqdm=False)
    finished = [check_output(backend, p.structured_outputs, o, schema)
                for p, o, schema in zip(params, outs, schemas)]
    assert sum(finished) >= len(finished) * 2 // 3, finished  # mostly complete, not just prefixes
    assert all(o.outputs[0].token_ids for o in outs[len(params):])


def test_any_whitespace_json_is_valid_or_a_valid_prefix(llm, backend):
    so = StructuredOutputsParams(json=SCHEMAS["nested"])
    obj = StructuredOutputsParams(json_object=True)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=s)
              for i, s in enumerate([so, so, obj, obj])]
    outs = llm.generate(PROMPTS[:2] * 2, params, use_tqdm=False)
    for p, o in zip(params, outs):
        check_output(backend, p.structured_outputs, o,
                     SCHEMAS["nested"] if p.structured_outputs.json else None)


def test_regex_choice_and_grammar_outputs(llm, backend):
    specs = [StructuredOutputsParams(regex=r"[a-c]{2,4}-\d{2}"),
             StructuredOutputsParams(regex=r"(yes|no)( maybe)?"),
             StructuredOutputsParams(choice=["red", "green", "blue", "dark green"]),
             StructuredOutputsParams(grammar=ARITH)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=24, structured_outputs=s)
              for i, s in enumerate(specs) for t in (0.0, 1.0)]
    outs = llm.generate(PROMPTS[:2] * len(specs), params, use_tqdm=False)
    for p, o in zip(params, outs):
        finished = check_output(backend, p.structured_outputs, o)
        if p.structured_outputs.grammar is not None and finished:
            assert arith_parses(o.outputs[0].text), o.outputs[0].text
        if p.structured_outputs.grammar is None:  # short languages always finish in 24 tokens
            assert finished


def test_unconstrained_greedy_outputs_unchanged_by_constrained_neighbours(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3
    neighbours_free = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3
    neighbours_constrained = [
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=s) for s in
        (StructuredOutputsParams(json=SCHEMAS["array"]), StructuredOutputsParams(regex="[a-z]+"),
         StructuredOutputsParams(choice=["x", "yy"]))]
    prompts = PROMPTS + ["Once upon a time", "Numbers matter too", "Goodbye"]
    free = llm.generate(prompts, plain + neighbours_free, use_tqdm=False)
    mixed = llm.generate(prompts, plain + neighbours_constrained, use_tqdm=False)
    for a, b in zip(free[:3], mixed[:3]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    for a, b in zip(alone, mixed[:3]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_grammar_that_cannot_finish_ends_length_with_a_valid_prefix(llm, backend):
    so = StructuredOutputsParams(regex="(ab){40}")
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6,
                                                    structured_outputs=so), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    assert re.fullmatch("(ab)*a?", c.text) and is_valid_prefix(backend, so, c.token_ids)


def test_n_samples_and_preemption_keep_outputs_valid(model_dir, backend):
    """Each of n samples has its own matcher; a request preempted and recomputed keeps its
    matcher's state (its output tokens are not fed twice)."""
    small = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 24, "block_size": 4},
                platform={"num_threads": 1}, structured_output={"disable_any_whitespace": True})
    roomy = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 512},
                platform={"num_threads": 1}, structured_output={"disable_any_whitespace": True})
    so = StructuredOutputsParams(json=SCHEMAS["nested"])
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
    a = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions_total > 0
    b = roomy.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        check_output(backend, so, x, SCHEMAS["nested"])
    outs = roomy.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=1,
                                                       max_tokens=60, structured_outputs=so),
                          use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMAS["nested"])
    small.shutdown()
    roomy.shutdown()


def test_bad_spec_fails_that_request_and_the_engine_goes_on(llm, monkeypatch):
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate(PROMPTS, [SamplingParams(max_tokens=4)] * 2 + [SamplingParams(
            structured_outputs=StructuredOutputsParams(json={"type": "array",
                                                             "uniqueItems": True}))])
    # a compile failure inside the engine core: that request ends "error", the rest run
    real = XgrammarBackend.compile

    def compile_or_fail(self, key):
        if key[1] == "zz+":
            raise GrammarCompileError("structured_outputs.regex: cannot compile: boom")
        return real(self, key)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_or_fail)
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="zz+")),
        SamplingParams(temperature=0.0, max_tokens=4)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "boom" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].finish_reason == "length"
    assert llm.engine.kv_cache_manager.usage == 0.0
