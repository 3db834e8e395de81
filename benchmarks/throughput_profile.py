"""Where workload A's time goes (issue 30: 64 prompts x (128 + 128) tokens on the default model,
Q4_1 kept): prefill steps against decode steps, and a torch.profiler table of one prefill step
and one 64-row decode step.

    python benchmarks/throughput_profile.py [--requests 64] [--input-len 128] [--output-len 128]
        [--profile] [overrides ...]

``overrides`` are engine settings (``platform.isa=avx512_bf16``, ``scheduler.max_num_batched_
tokens=4096``). Step graphs are off by default (``compilation.mode=eager``): a 64-row decode
step is eager either way, and a compile would share the cores with the run. On a shared
machine the absolute times move with the load; the shares within one run are what to read.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import time

os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import torch  # noqa: E402


class Steps:
    """A step observer: seconds per step, split by kind (a step with prompt tokens is prefill)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, float, float]] = []

    def on_step(self, ev) -> None:
        s = ev.split
        self.rows.append((s.prefill_tokens, s.decode_tokens, ev.num_reqs,
                          ev.execute_s, ev.schedule_s + ev.update_s))

    def summary(self) -> str:
        by = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
        for pt, dt, _, ex, other in self.rows:
            kind = "prefill" if pt else "decode"
            by[kind][0] += 1
            by[kind][1] += ex
            by[kind][2] += other
            by[kind][3] += pt + dt
        total = sum(v[1] + v[2] for v in by.values())
        return "\n".join(
            f"  {k:8s} {v[0]:4d} steps {v[3]:6d} tokens: execute {v[1]:7.2f} s, "
            f"schedule+update {v[2]:5.2f} s ({100 * (v[1] + v[2]) / total:4.1f}% of steps)"
            for k, v in sorted(by.items()))


def profiled_steps(executor, picks: dict[str, callable]):
    """Wrap ``executor.execute_model`` so the first step each predicate in ``picks`` accepts runs
    under torch.profiler; returns the tables keyed by the pick's name."""
    tables: dict[str, str] = {}
    inner = executor.execute_model

    def execute(so, *a, **k):
        n = so.total_num_scheduled_tokens
        reqs = len(so.num_scheduled_tokens)
        for name, pick in picks.items():
            if name not in tables and pick(n, reqs):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                            ) as prof:
                    t0 = time.perf_counter()
                    out = inner(so, *a, **k)
                    wall = time.perf_counter() - t0
                avg = prof.key_averages()
                ops = sum(e.self_cpu_time_total for e in avg) / 1e6
                tables[name] = (f"{name}: {n} tokens, {reqs} requests, {wall * 1e3:.1f} ms "
                                f"(profiled); ops' self time {ops * 1e3:.1f} ms\n"
                                + avg.table(sort_by="self_cpu_time_total", row_limit=18))
                return out
        return inner(so, *a, **k)

    executor.execute_model = execute
    return tables


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from llmkit.engine.llm import LLM
    from llmkit.sampling.params import SamplingParams

    overrides = ["compilation.mode=eager", *args.overrides]
    llm = LLM(None, overrides=overrides)
    print("backend:", llm.engine.backend_info)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100)
                                     for _ in range(args.input_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    tables = {}
    if args.profile:
        tables = profiled_steps(llm.engine.executor, {
            "prefill step": lambda n, r: n > r,
            "64-row decode step": lambda n, r: n == r == args.requests})
    steps = Steps()
    llm.engine.add_step_observer(steps)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    step_s = sum(r[3] + r[4] for r in steps.rows)
    print(f"{n_out} tokens in {wall:.2f} s: {n_out / wall:.1f} output tok/s; steps "
          f"{step_s:.2f} s ({100 * step_s / wall:.1f}% of the wall time)")
    print(steps.summary())
    for t in tables.values():
        print(t)


if __name__ == "__main__":
    main()
