"""One decode step at tensor_parallel_size=1 vs 2 (executor=multiproc), the seed's "TP x2 does
not halve latency": the two engines live side by side and are alternated (A, B, A, B, ...);
each round decodes ``--tokens`` tokens of one request and the engine's own step timings
(``StepEvent.execute_s``) of the decode steps are collected. Medians and the spread (min-max
of the per-round medians) are printed with the TP=2 / TP=1 ratio.

    python benchmarks/tp_decode_bench.py [--rounds 3] [--tokens 24] [--hidden 512] [--layers 4]

The model is a random Llama built here (float32, 8 heads / 4 KV heads) so that its heads split
over two ranks; on a machine others use, compare the two within one run only.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


class DecodeSteps:
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step(self, event) -> None:
        if event.scheduler_output.total_num_scheduled_tokens == 1:  # one request decoding
            self.times.append(event.execute_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()

    from helpers.tiny_models import build_model_dir, build_tokenizer

    from llmkit import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_dir("llama", Path(tmp) / "m", build_tokenizer(),
                               hidden_size=args.hidden, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=args.hidden // 8,
                               intermediate_size=3 * args.hidden,
                               num_hidden_layers=args.layers)
        common = dict(dtype="float32", overrides=["compilation.mode=eager"])
        engines = {1: LLM(str(path), **common),
                   2: LLM(str(path), parallel={"tensor_parallel_size": 2}, **common)}
        sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        medians: dict[int, list[float]] = {1: [], 2: []}
        try:
            for _ in range(args.rounds):
                for tp, llm in engines.items():
                    obs = DecodeSteps()
                    llm.engine.add_step_observer(obs)
                    llm.generate(["The quick brown fox"], sp, use_tqdm=False)
                    llm.engine.remove_step_observer(obs)
                    medians[tp].append(statistics.median(obs.times) * 1e3)
        finally:
            for llm in engines.values():
                llm.engine.shutdown()
    for tp, ms in medians.items():
        print(f"TP={tp}: decode step median {statistics.median(ms):.2f} ms "
              f"(round medians {min(ms):.2f}-{max(ms):.2f} ms)")
    print(f"TP=2 / TP=1: {statistics.median(medians[2]) / statistics.median(medians[1]):.2f}")


if __name__ == "__main__":
    main()
