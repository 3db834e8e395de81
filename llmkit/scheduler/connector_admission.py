"""The scheduler's side of a KV connector (``llmkit/kv_transfer``): requests whose KV another
engine or a lower tier brings, and finished requests whose blocks stay held for a receiver.

A waiting request that the connector can load asynchronously gets its blocks, then waits
(``WAITING_FOR_REMOTE_KVS``) until the worker reports the load finished; it then runs from the
loaded position (or recomputes, if the load failed). A finished request that a receiver loads
keeps its blocks until the worker reports it sent. An aborted request whose load is under way
keeps its blocks until the load ends (the worker may still be writing them).

The scheduler turns this feature on when it is given a connector.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llmkit.kv_cache.base import KVCacheManagerBase
from llmkit.request import Request, RequestStatus
from llmkit.scheduler.base import SchedulerOutput, SchedulerStats
from llmkit.scheduler.hooks import SchedulerFeature

if TYPE_CHECKING:
    from llmkit.kv_transfer.base import KVConnectorBase
    from llmkit.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
    from llmkit.scheduler.step_phases import WaitingQueue

logger = logging.getLogger(__name__)


class KVConnectorAdmission(SchedulerFeature):
    name = "connector"

    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManagerBase,
                 waiting: WaitingQueue) -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.waiting = waiting
        # Requests whose KV loads, with the number of tokens it brings; those whose load
        # finished, waiting to run; finished requests whose blocks stay held for a receiver;
        # aborted requests whose blocks are freed once their load ends.
        self.waiting_for_remote: dict[str, tuple[Request, int]] = {}
        self.loaded: set[str] = set()
        self.sending: dict[str, Request] = {}
        self.free_after_recv: dict[str, Request] = {}

    # -- hooks -------------------------------------------------------------------------------
    def holds_kv(self, req: Request) -> bool:
        """Whether the request's KV was loaded: it holds its blocks already."""
        return bool(self.loaded) and req.request_id in self.loaded

    def match_external(self, req: Request, num_hit: int) -> tuple[int, bool]:
        """(tokens the connector brings past the local prefix hit, whether it loads them
        asynchronously)."""
        return self.connector.get_num_new_matched_tokens(req, num_hit)

    def parked(self, req: Request, lookup: bool, num_hit: int, num_ext: int,
               load_async: bool) -> bool:
        if lookup:
            self.allocated(req, num_ext)
        if load_async:
            self.wait_for_load(req, num_hit, num_ext)
        return load_async

    def admitted(self, req: Request) -> None:
        """A loaded request runs."""
        self.loaded.discard(req.request_id)

    def drop_held(self, req: Request) -> bool | None:
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return None
        # The worker may still write its blocks: they are freed when the load ends.
        self.abort_load(req)
        return False

    def finished(self, req: Request, free_blocks: bool) -> bool:
        self.loaded.discard(req.request_id)  # an aborted request that was loaded
        return self.request_finished(req, free_blocks)

    def final_output(self, req: Request, out: EngineCoreOutput) -> None:
        out.kv_transfer_params = req.kv_transfer_params

    def end_step(self, out: SchedulerOutput) -> None:
        out.kv_connector_metadata = self.connector.build_connector_meta()

    def busy(self) -> bool:
        return bool(self.waiting_for_remote)

    def begin_update(self, runner_output: ModelRunnerOutput) -> None:
        kv_out = runner_output.kv_connector_output
        if kv_out is not None:
            for req in self.update_from_output(kv_out):
                self.waiting.add_preempted(req)  # ahead of newer work: it holds blocks

    def num_held(self) -> int:
        return len(self.waiting_for_remote)

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.kv_connector = self.connector.stats.snapshot()

    # -- the protocol's steps --------------------------------------------------------------
    def allocated(self, req: Request, num_external_tokens: int) -> None:
        """The request got its blocks: the connector may plan its load into them."""
        self.connector.update_state_after_alloc(
            req, self.kv.get_block_ids(req.request_id), num_external_tokens)

    def wait_for_load(self, req: Request, num_hit: int, num_external_tokens: int) -> None:
        req.set_status(RequestStatus.WAITING_FOR_REMOTE_KVS)
        req.num_computed_tokens = num_hit
        self.waiting_for_remote[req.request_id] = (req, num_external_tokens)

    def abort_load(self, req: Request) -> None:
        """An aborted request whose load is under way: its blocks are freed when it ends."""
        del self.waiting_for_remote[req.request_id]
        self.free_after_recv[req.request_id] = req

    def request_finished(self, req: Request, free_blocks: bool) -> bool:
        """Tell the connector; whether the scheduler frees the request's blocks now (not while
        a receiver loads them: they are freed when the worker says it is done)."""
        delay, req.kv_transfer_params = self.connector.request_finished(
            req, self.kv.get_block_ids(req.request_id))
        if delay and free_blocks:
            self.sending[req.request_id] = req
            return False
        return free_blocks

    def update_from_output(self, out: KVConnectorOutput) -> list[Request]:
        """Finished transfers: loaded requests may run (or recompute, if the load failed);
        a receiver has a producer's blocks, which are freed now. Returns the requests to put
        back at the head of the waiting queue, in order (they hold blocks)."""
        self.connector.update_connector_output(out)
        requeue: list[Request] = []
        failed = set(out.failed_recving)
        for rid in out.finished_recving:
            aborted = self.free_after_recv.pop(rid, None)
            if aborted is not None:
                self.kv.free(aborted)
                continue
            entry = self.waiting_for_remote.pop(rid, None)
            if entry is None:
                continue
            req, num_ext = entry
            req.set_status(RequestStatus.WAITING)
            if rid in failed:
                # Recompute: its blocks go back and it is admitted anew (the connector does
                # not match it again).
                logger.warning("request %r: its KV could not be loaded; recomputing it", rid)
                self.kv.free(req)
                req.num_computed_tokens = 0
            else:
                req.num_computed_tokens += num_ext
                self.kv.cache_blocks(req, req.num_computed_tokens)
                self.loaded.add(rid)
            requeue.append(req)
        for rid in out.finished_sending:
            req = self.sending.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        return requeue

    def holds_work(self) -> bool:
        """Finished requests hold blocks until their transfers end."""
        return bool(self.sending) or bool(self.free_after_recv)
