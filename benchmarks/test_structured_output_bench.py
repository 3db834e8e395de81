"""Structured output on the default model (SmolLM2-135M-Instruct), issue 19's closing figures:

1. 32 concurrent chat requests constrained by a JSON schema against the same 32 requests
   unconstrained: output tokens/s of each and the ratio (aim: >= 0.9x). The unconstrained run
   generates exactly as many tokens per request as its constrained twin did (``max_tokens`` =
   that length, ``ignore_eos``), so both runs have the same batch shape step by step and the
   ratio is the cost of compiling, filling and applying the bitmask (and the gain of ending a
   request as soon as only EOS may follow). Runs alternate (A, B, A, B, ...); medians and the
   spread of the ratio are printed.
2. Time to compile a schema: cold (a spec the cache has not seen, from ``grammar_init`` to
   ready, and xgrammar's compile alone) and from the cache.

Run: ``pytest benchmarks/test_structured_output_bench.py --benchmark-only -s``
(``LLMKIT_BENCH_ROUNDS=N`` pairs of runs, default 3).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import pytest

from llmkit import LLM, SamplingParams, StructuredOutputsParams
from llmkit.request import Request

NUM_REQUESTS = 32
MAX_TOKENS = 64
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome", "Madrid", "Lisbon"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                "minItems": 1, "maxItems": 3},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "hobbies", "employed"]}
PEOPLE = ["a baker", "a pilot", "a painter", "a student", "a nurse", "a chef", "a poet",
          "a farmer"]


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content":
            f"Describe {PEOPLE[i % len(PEOPLE)]} number {i} as JSON with name, age, city, "
            "hobbies and employed."}]) for i in range(NUM_REQUESTS)]


def _run(llm: LLM, prompts, params) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), outs


def _compile_times(llm: LLM, rounds: int) -> dict[str, float]:
    """Cold: a schema the cache has not seen (maxLength varied), grammar_init → ready; the
    compile alone is the manager's own measure. Cached: the same spec again."""
    mgr = llm.engine.structured_output_manager
    cold, compile_only, cached = [], [], []
    for i in range(rounds * 3):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"]["name"]["maxLength"] = 100 + i  # a new spec: a cold compile
        for bucket in (cold, cached):
            req = Request(f"c{i}-{len(bucket)}", [1], SamplingParams(
                structured_outputs=StructuredOutputsParams(json=schema)), eos_token_id=2)
            t0 = time.perf_counter()
            mgr.grammar_init(req)
            while not mgr.is_ready(req):
                time.sleep(0.0002)
            bucket.append(time.perf_counter() - t0)
            assert req.structured_output_request.grammar is not None
        compile_only.append(mgr.compile_times[req.structured_output_request.key])
    return {"cold_ms": 1e3 * statistics.median(cold),
            "compile_only_ms": 1e3 * statistics.median(compile_only),
            "cached_ms": 1e3 * statistics.median(cached),
            "cold_spread_ms": 1e3 * (max(cold) - min(cold))}


@pytest.mark.benchmark(group="structured output")
def test_json_schema_throughput_vs_unconstrained(benchmark):
    rounds = int(os.environ.get("LLMKIT_BENCH_ROUNDS", "3"))
    llm = LLM(None, scheduler={"max_num_seqs": NUM_REQUESTS})  # the default model
    prompts = _prompts(llm)
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)
                   for _ in prompts]
    # warm-up: the backend (tokenizer info), the grammar, the kernels
    _run(llm, prompts[:4], constrained[:4])
    _, _, first = _run(llm, prompts, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in first]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    finished = sum(o.outputs[0].finish_reason == "stop" for o in first)

    def measure():
        tok_s = {"json": [], "free": []}
        for _ in range(rounds):
            for name, params in (("json", constrained), ("free", free)):
                elapsed, tokens, _ = _run(llm, prompts, params)
                tok_s[name].append(tokens / elapsed)
        return tok_s

    tok_s = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratios = [a / b for a, b in zip(tok_s["json"], tok_s["free"])]
    ratio = statistics.median(ratios)
    compile_times = _compile_times(llm, rounds)
    benchmark.extra_info.update(
        ratio=ratio, ratio_min=min(ratios), ratio_max=max(ratios),
        json_tok_s=statistics.median(tok_s["json"]), free_tok_s=statistics.median(tok_s["free"]),
        output_tokens=sum(lengths), finished=finished, **compile_times)
    print(f"\n{NUM_REQUESTS} requests, {sum(lengths)} output tokens each run, {finished} of "
          f"{NUM_REQUESTS} JSON outputs complete within {MAX_TOKENS} tokens")
    print(f"JSON schema: {statistics.median(tok_s['json']):.1f} tok/s, unconstrained: "
          f"{statistics.median(tok_s['free']):.1f} tok/s, ratio {ratio:.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f} over {rounds} alternated pairs)")
    print("schema compile: cold {cold_ms:.1f} ms (xgrammar's compile {compile_only_ms:.1f} ms; "
          "spread {cold_spread_ms:.1f} ms), cached {cached_ms:.3f} ms".format(**compile_times))
    for o in first:
        if o.outputs[0].finish_reason == "stop":
            json.loads(o.outputs[0].text)
    llm.shutdown()
    assert ratio > 0
