"""``ModelRunner.prepare_inputs``: a step's ``SchedulerOutput`` → ``input_ids``, ``positions``,
``slot_mapping``, block table and the attention backend's metadata (torch backend), on real
scheduler outputs.

The runner holds a stub model (zero hidden states → a greedy sampler picks token 0), so the
persistent batch evolves exactly as in the engine; only ``prepare_inputs`` is timed, on three
steps: 128 decodes, a 4096-token prefill of new requests, and a mixed step (64 decodes + a
chunk of prefill). Block size 16, max_model_len 4096.

Run: ``pytest benchmarks/test_prepare_inputs_bench.py --benchmark-only``.
"""
from __future__ import annotations

import pytest
import torch

from llmkit.attention.torch_backend import TorchAttentionBackend
from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.request import Request
from llmkit.sampling import SamplingParams
from llmkit.sampling.sampler import TorchSampler
from llmkit.scheduler.token_budget import TokenBudgetScheduler
from llmkit.worker.model_runner import ModelRunner

VOCAB, MAX_LEN, BLOCK = 1024, 4096, 16


class StubModel(torch.nn.Module):
    """Hidden states of zeros; logits of zeros (greedy → token 0)."""

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], VOCAB)


def make_engine(max_num_seqs: int = 256, budget: int = 4096):
    kv = KVCacheManager(8192, BLOCK, enable_prefix_caching=False, max_model_len=MAX_LEN)
    sched = TokenBudgetScheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=budget),
                                 kv, max_model_len=MAX_LEN, eos_token_id=None)
    runner = ModelRunner(StubModel(), TorchAttentionBackend(), TorchSampler(seed=0),
                         max_num_reqs=max_num_seqs, max_model_len=MAX_LEN, block_size=BLOCK,
                         num_lookahead_tokens=0, kv_cache_dtype=torch.float32,
                         device=torch.device("cpu"))
    return sched, runner


def add(sched, n: int, prompt_len: int, start: int = 0) -> None:
    for i in range(start, start + n):
        prompt = [(7 * i + j) % (VOCAB - 3) + 3 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt,
                                  SamplingParams(max_tokens=2048, ignore_eos=True)))


def step(sched, runner) -> None:
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))


def next_output(sched, runner):
    """The next step's SchedulerOutput, applied to the persistent batch but not executed."""
    so = sched.schedule()
    runner._update_states(so)
    return so


def decode_step():
    sched, runner = make_engine()
    add(sched, 128, 200)
    while len(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                    for r in sched.running):
        step(sched, runner)
    return runner, next_output(sched, runner)


def prefill_step():
    sched, runner = make_engine()
    add(sched, 16, 256)
    return runner, next_output(sched, runner)


def mixed_step():
    sched, runner = make_engine()
    add(sched, 64, 100)
    while len(sched.waiting):
        step(sched, runner)
    step(sched, runner)
    add(sched, 8, 1000, start=64)
    return runner, next_output(sched, runner)


CASES = {"decode_128": decode_step, "prefill_4096": prefill_step, "mixed_64d": mixed_step}


@pytest.mark.benchmark(group="prepare_inputs")
@pytest.mark.parametrize("case", list(CASES))
def test_prepare_inputs(benchmark, case):
    runner, so = CASES[case]()
    inputs = benchmark(runner.prepare_inputs, so)
    assert inputs.input_ids.shape[0] == so.total_num_scheduled_tokens
    benchmark.extra_info.update(tokens=so.total_num_scheduled_tokens,
                                reqs=len(so.num_scheduled_tokens))
