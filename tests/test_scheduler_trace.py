"""The scheduler's decisions on the shared scheduler trace, step for step, under each feature.

Every step's scheduled requests and tokens (in order), new and cached request data (block ids
included), drafts, preemptions, finished ids and outputs are folded into one digest per
configuration. The digests were recorded from the scheduler before its features moved into
hooks (``llmkit/scheduler/hooks.py``); a restructuring that changes any decision changes one.
"""
from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import pytest

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request
from llmkit.sampling import SamplingParams
from llmkit.scheduler.token_budget import TokenBudgetScheduler


@pytest.fixture(scope="module")
def trace():
    path = str(Path(__file__).resolve().parents[1] / "benchmarks")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(path)
    try:
        return importlib.import_module("sched_trace").make_trace
    finally:
        mp.undo()


def record(make_trace, n: int, num_blocks: int, cfg: dict, *, lora: bool = False,
           priority: bool = False, drafts: bool = False, **sched_kw) -> str:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=True, max_model_len=4096)
    sched = TokenBudgetScheduler(
        SchedulerConfig(**{"max_num_seqs": 128, "max_num_batched_tokens": 4096, **cfg}), kv,
        max_model_len=4096, eos_token_id=None, clock=iter(range(10**9)).__next__, **sched_kw)
    for i, (rid, prompt, max_tokens) in enumerate(make_trace(n=n, seed=0)):
        sched.add_request(Request(
            rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            lora_id=(i % 4 or None) if lora else None, priority=i % 3 if priority else 0))
    h = hashlib.sha256()
    step = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        c = out.scheduled_cached_reqs
        h.update(repr((
            list(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids),
            sorted(out.finished_req_ids),
            [(r.req_id, r.num_computed_tokens, r.block_ids, len(r.token_ids), r.lora_id)
             for r in out.scheduled_new_reqs],
            c.req_ids, c.new_block_ids, c.num_computed_tokens, c.block_ids_offset,
            c.new_token_ids, out.scheduled_spec_tokens, out.total_num_scheduled_tokens,
        )).encode())
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for j, rid in enumerate(ids):
            r = sched.requests[rid]
            if r.num_computed_tokens < r.num_tokens:
                sampled.append([])
                continue
            k = len(out.scheduled_spec_tokens.get(rid, ()))
            # accept a deterministic share of the drafts
            sampled.append([5] * (1 + (step + j) % (k + 1)) if k else [5])
        outs = sched.update_from_output(out, ModelRunnerOutput(ids, sampled))
        h.update(repr([(o.request_id, o.new_token_ids, o.finish_reason) for o in outs]).encode())
        if drafts:
            sched.update_draft_token_ids({r.request_id: [7] * (1 + (step + len(r.request_id)) % 3)
                                          for r in sched.running})
        step += 1
    st = sched.stats()
    h.update(repr((step, st.num_preemptions_total, st.prefix_cache_queries,
                   st.prefix_cache_hits, st.spec_decode.num_draft_tokens,
                   st.spec_decode.num_accepted_tokens)).encode())
    assert kv.num_free_blocks == kv.num_blocks
    return h.hexdigest()[:16]


CASES = {
    # the bench's configuration: the whole trace
    "default": (dict(n=256, num_blocks=4096, cfg={}), "895d0ea1156afa68"),
    # blocks are scarce: many preemptions (lifo), re-admissions with prefix hits
    "scarce": (dict(n=96, num_blocks=600, cfg={}), "4a9e64879743641b"),
    "priority_fewest_computed": (dict(n=96, num_blocks=700, priority=True, cfg=dict(
        policy="priority", preemption_policy="fewest_computed_tokens",
        long_prefill_token_threshold=300)), "56c4ea81084f1dec"),
    "no_chunked_prefill": (dict(n=96, num_blocks=800, cfg=dict(
        enable_chunked_prefill=False, max_num_batched_tokens=2048, max_num_seqs=32)),
        "59ee421b95b1a406"),
    "lora_slots": (dict(n=96, num_blocks=800, lora=True, max_loras=2, max_lora_skips=3,
                        cfg={}), "4d6f048b71050455"),
    "drafts": (dict(n=96, num_blocks=700, drafts=True, cfg=dict(num_lookahead_tokens=2)),
               "0c9369043a94c038"),
    "eagle_drop_last_block": (dict(n=96, num_blocks=800, drop_last_cached_block=True, cfg={}),
                              "9a076e7416c75ffa"),
    "pipeline_parallel": (dict(n=96, num_blocks=800, pipeline_parallel_size=2, cfg={}),
                          "d8c04833ab81341a"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trace_decisions_unchanged(trace, case):
    kwargs, digest = CASES[case]
    assert record(trace, **kwargs) == digest
