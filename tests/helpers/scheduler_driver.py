"""Driving a scheduler without a model: requests with disjoint prompts, and a fake runner."""
from __future__ import annotations

from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request
from llmkit.sampling import SamplingParams


def fake_run(sched, out, token=7):
    """Sample ``token`` for every request whose step reaches the end of its known tokens."""
    sampled = []
    for rid in out.num_scheduled_tokens:
        req = sched.requests.get(rid)
        sampled.append([token] if req is not None and req.num_computed_tokens >= req.num_tokens
                       else [])
    return sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))


def req(rid, n, max_tokens=4, **kw):
    """A request whose prompt shares no block with other ids' prompts."""
    base = 1000 * (1 + sum(map(ord, rid)))
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens, **kw))
