"""The scheduler's side of the KV connector protocol, without a model (a scripted connector):
matching is not readiness (a request whose KV loads asynchronously is not scheduled, and its
blocks are not reusable by others, until the load finished); compute finished is not blocks
reclaimable (a producer's blocks stay held until the worker reports the send done); aborts and
failed loads leak nothing."""
from __future__ import annotations

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.kv_transfer.base import KVConnectorBase
from llmkit.outputs import KVConnectorOutput, ModelRunnerOutput
from llmkit.request import Request, RequestStatus
from llmkit.sampling import SamplingParams
from llmkit.scheduler.token_budget import TokenBudgetScheduler

BS = 4


class ScriptedConnector(KVConnectorBase):
    """Offers every prompt but its last token asynchronously to requests whose
    ``kv_transfer_params`` ask for it; holds blocks of requests that ask to send."""

    def __init__(self) -> None:  # no config or layout needed for the scheduler's side
        from llmkit.kv_transfer.base import KVConnectorStats

        self.stats = KVConnectorStats()
        self.allocs: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params
        if p and p.get("load"):
            return request.num_prompt_tokens - 1 - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if request.kv_transfer_params and request.kv_transfer_params.get("load"):
            request.kv_transfer_params = None
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self):
        return None

    def request_finished(self, request, block_ids):
        p = request.kv_transfer_params
        if p and p.get("send") and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return True, {"handle": request.request_id}
        return False, None


def _make(num_blocks: int = 32):
    kv = KVCacheManager(num_blocks, BS, max_model_len=128)
    conn = ScriptedConnector()
    sched = TokenBudgetScheduler(SchedulerConfig(max_num_batched_tokens=64), kv,
                                 max_model_len=128, kv_connector=conn)
    return sched, kv, conn


def _req(rid: str, prompt: list[int], max_tokens: int = 4, **kv_params) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               extra_args={"kv_transfer_params": kv_params}
                                               if kv_params else None))


def _run(sched, so, kv_out: KVConnectorOutput | None = None):
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
            else [] for r in ids]
    return sched.update_from_output(so, ModelRunnerOutput(ids, toks, kv_connector_output=kv_out))


PROMPT = list(range(10, 27))  # 17 tokens: 4 full blocks + 1


def test_a_loading_request_waits_and_its_blocks_are_not_a_prefix_hit_yet():
    sched, kv, conn = _make()
    sched.add_request(_req("r", PROMPT, load=True))
    so = sched.schedule()
    r = sched.requests["r"]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and so.num_scheduled_tokens == {}
    assert conn.allocs == [("r", kv.get_block_ids("r"), 16)]
    # another request with the same prompt finds nothing cached: the KV is not there yet
    other = _req("o", PROMPT)
    assert kv.get_computed_blocks(other) == ([], 0)
    _run(sched, so)
    assert sched.schedule().num_scheduled_tokens == {}  # still loading
    _run(sched, sched.schedule(), KVConnectorOutput(finished_recving=["r"]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 1}  # only the last prompt token is computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert r.status == RequestStatus.RUNNING and r.num_cached_tokens == 16
    # loaded, the blocks are a prefix hit for others
    assert kv.get_computed_blocks(_req("o2", PROMPT))[1] == 16


def test_a_failed_load_recomputes_from_scratch():
    sched, kv, conn = _make()
    sched.add_request(_req("r", PROMPT, load=True))
    _run(sched, sched.schedule())
    _run(sched, sched.schedule(), KVConnectorOutput(finished_recving=["r"],
                                                    failed_recving=["r"]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 17}
    assert sched.requests["r"].kv_transfer_params is None  # not matched again


def test_aborted_while_loading_frees_its_blocks_when_the_load_ends():
    sched, kv, conn = _make()
    sched.add_request(_req("r", PROMPT, load=True))
    _run(sched, sched.schedule())
    held = kv.num_free_blocks
    assert held < 32
    sched.abort(["r"])
    assert kv.num_free_blocks == held  # the worker may still write them
    assert sched.has_unfinished_requests()
    _run(sched, sched.schedule(), KVConnectorOutput(finished_recving=["r"]))
    assert kv.num_free_blocks == 32 and not sched.has_unfinished_requests()
    kv.check_integrity()


def test_a_producer_holds_blocks_until_the_send_is_done():
    sched, kv, conn = _make()
    sched.add_request(_req("p", PROMPT, max_tokens=1, send=True))
    outs = _run(sched, sched.schedule())
    assert outs[0].finish_reason == "length" and outs[0].kv_transfer_params == {"handle": "p"}
    assert kv.num_free_blocks < 32 and sched.has_unfinished_requests()
    _run(sched, sched.schedule())
    assert kv.num_free_blocks < 32  # still held: nobody said the receiver has them
    _run(sched, sched.schedule(), KVConnectorOutput(finished_sending=["p"]))
    assert kv.num_free_blocks == 32 and not sched.has_unfinished_requests()
    kv.check_integrity()
    # an aborted producer request is freed at once and hands nothing over
    sched.add_request(_req("q", PROMPT, max_tokens=3, send=True))
    _run(sched, sched.schedule())
    outs = sched.abort(["q"])
    assert outs[0].kv_transfer_params is None and kv.num_free_blocks == 32
