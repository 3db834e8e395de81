"""Where a speculative step's time goes at batch 1: the copy workload of
``bench_spec_decode.py`` through an engine without speculation and one with ``ngram``, in one
process, alternated, with CPU time (``time.thread_time`` of the engine thread, and the
process's) and wall time summed per phase of each engine step:

schedule, update (scheduler's update_from_output), drafts (update_draft_token_ids), states
(the runner's persistent-batch update), inputs (prepare_inputs), forward (the model: graph or
eager, counted), sample (logits + sampler/rejection), propose (the proposer), output (the
front end's detokenising), and the rest of the step.

Steps are split into prefill steps (a prompt chunk) and decode steps (one token, or one token
and its drafts: a verify step). Per engine it prints the per-phase totals per generated token,
and the ratio of a verify step's phases to a plain decode step's.

    python benchmarks/spec_step_phases.py [--reps 4] [--threads 1] [--max-tokens 128]

With ``--threads 1`` every kernel runs on the engine thread, so its CPU time is the step's
work alone, whatever else runs on the machine.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from bench_spec_decode import load_prompts, make_engines


class Phases:
    """CPU (thread, process) and wall seconds per phase, per step kind."""

    def __init__(self) -> None:
        self.sums: dict = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        self.steps = collections.Counter()
        self.kind = "idle"
        self.tokens = collections.Counter()  # forward tokens per step kind
        self.graph = collections.Counter()
        self.pending: list = []

    def add(self, phase: str, dt: tuple[float, float, float]) -> None:
        # a step's phases go to its kind once it ends (scheduling comes before it is known)
        self.pending.append((phase, dt))
        if phase != "step":
            return
        for p, d in self.pending:
            s = self.sums[(self.kind, p)]
            for i in range(3):
                s[i] += d[i]
        self.pending.clear()
        self.kind = "other"


def now() -> tuple[float, float, float]:
    return time.thread_time(), time.process_time(), time.perf_counter()


def wrap(obj, name: str, phases_of, phase: str, hook=None):
    """Replace ``obj.name`` with a timed call adding to ``phases_of()``'s phase."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        if hook is not None:
            hook(*a, **kw)
        t0 = now()
        try:
            return fn(*a, **kw)
        finally:
            t1 = now()
            phases_of().add(phase, tuple(y - x for x, y in zip(t0, t1)))

    setattr(obj, name, timed)


def instrument(llm, ph: Phases) -> None:
    core = llm.engine
    runner = core.executor.runner
    get = lambda: ph  # noqa: E731
    wrap(core.scheduler, "schedule", get, "schedule")
    wrap(core.scheduler, "update_from_output", get, "update")
    wrap(core.scheduler, "update_draft_token_ids", get, "drafts")
    wrap(runner, "_update_states", get, "states")

    def kind_of(so):
        n = so.total_num_scheduled_tokens
        spec = sum(len(v) for v in (so.scheduled_spec_tokens or {}).values())
        if n == 0:
            ph.kind = "empty"
        elif n - spec > len(so.num_scheduled_tokens):
            ph.kind = "prefill"
        else:
            ph.kind = "verify" if spec else "decode"
        ph.steps[ph.kind] += 1
        ph.tokens[ph.kind] += n

    wrap(runner, "prepare_inputs", get, "inputs", hook=kind_of)
    if runner.proposer is not None:
        wrap(runner.proposer, "propose", get, "propose")
    wrap(llm.frontend, "process_outputs", get, "output")
    wrap(llm, "_step", get, "step")


CURRENT: list = []


def instrument_modules() -> None:
    """The runner's forward (a method of every runner) and the module functions it calls by
    name: one wrapper for both engines, adding to the engine in use (``CURRENT``)."""
    import llmkit.worker.model_runner as mr

    cur = lambda: CURRENT[0]  # noqa: E731
    wrap(mr.ModelRunner, "_forward", cur, "forward")
    wrap(mr, "sample_step", cur, "sample")
    base_gc = mr._graph_computes

    def counted(*a, **kw):
        r = base_gc(*a, **kw)
        ph = CURRENT[0]
        ph.graph[(ph.kind, bool(r))] += 1
        return r

    mr._graph_computes = counted


def run(llm, prompts, max_tokens: int, salt: str) -> tuple[int, float, float]:
    from llmkit import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], params,
                        use_tqdm=False)
    return (sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0,
            time.process_time() - c0), [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engines, _, _ = make_engines(args.k, args.threads)
    prompts = load_prompts(engines["none"])
    for llm in engines.values():
        run(llm, prompts[:2], 32, "warmup")
    for name, llm in engines.items():
        print(f"{name}: step graphs {llm.engine.executor.runner.step_graphs}")
    phases = {name: Phases() for name in engines}
    for name, llm in engines.items():
        instrument(llm, phases[name])
    instrument_modules()
    totals = {name: [0, 0.0, 0.0] for name in engines}
    ratios, cpu_ratios = [], []
    same = True
    for rep in range(args.reps):
        chosen = [prompts[rep % len(prompts)]]
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        got = {}
        for name in order:
            CURRENT[:] = [phases[name]]
            (tok, wall, cpu), outs = run(engines[name], chosen, args.max_tokens,
                                         f"r{rep}-{name}")
            got[name] = (tok / wall, tok / cpu, outs)
            t = totals[name]
            t[0] += tok
            t[1] += wall
            t[2] += cpu
        same &= got["none"][2] == got["ngram"][2]
        ratios.append(got["ngram"][0] / got["none"][0])
        print(f"rep {rep}: prompt {len(chosen[0])} tokens, {len(got['none'][2][0])} out; "
              f"ngram/none {ratios[-1]:.2f} (none {got['none'][0]:.1f} tok/s)", flush=True)
        cpu_ratios.append(got["ngram"][1] / got["none"][1])
    print(f"greedy identical: {same}")
    print(f"ngram/none tok/s ratio: median {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}); by process CPU time "
          f"{statistics.median(cpu_ratios):.2f} ({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})")
    for name, ph in phases.items():
        tok, wall, cpu = totals[name]
        print(f"\n== {name}: {tok} tokens, {tok / wall:.1f} tok/s wall, {tok / cpu:.1f} "
              f"tok/s process-CPU; steps {dict(ph.steps)}; forward tokens "
              f"{dict(ph.tokens)}; graph {dict(ph.graph)}")
        kinds = sorted({k for k, _ in ph.sums})
        for kind in kinds:
            n = ph.steps.get(kind, 0) or 1
            line = "  ".join(
                f"{p} {1e3 * ph.sums[(kind, p)][0] / n:.3f}/{1e3 * ph.sums[(kind, p)][2] / n:.3f}"
                for p in ("step", "schedule", "states", "inputs", "forward", "sample",
                          "propose", "update", "drafts", "output")
                if (kind, p) in ph.sums)
            print(f"  {kind:8s} x{ph.steps.get(kind, 0)} ms/step thread-CPU/wall: {line}")
    if args.out:
        Path(args.out).write_text(json.dumps({"ratios": ratios, "cpu_ratios": cpu_ratios}))


if __name__ == "__main__":
    main()
