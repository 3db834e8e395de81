"""``DPRouter``: which of the data-parallel engine cores serves a new request.

The rule (vLLM's DP load balancer, plus prefix affinity):

1. **Load.** A core's load is ``4 * waiting + running``: its scheduler's counts as it last
   reported them (each core sends its stats with every batch of outputs), plus the requests
   routed to it since that report (counted as waiting, so that a burst sent between two
   reports spreads instead of herding onto the core that looked idle). Waiting requests weigh
   more because they still need a prefill and hold a place in the queue.
2. **Prefix affinity.** A prompt's *prefix keys* are the hashes of its first full KV blocks
   (chained like the prefix cache's block hashes, up to ``affinity_blocks`` of them), rooted in
   the LoRA adapter and the cache salt, which also separate KV in the prefix cache. The router
   remembers which core each key was last sent to (an LRU table). A new request prefers the
   core of its *longest* remembered key: that core's prefix cache likely holds those blocks.
3. **Fallback.** The preferred core is taken unless its load exceeds the least-loaded core's by
   more than ``max(affinity_slack, affinity_ratio * least)``; then the least-loaded core
   serves the request (ties: the lowest index) and the request's keys move there. A prompt
   shorter than one block has no key and always goes to the least-loaded core.

Every engine request of one user request (the ``n > 1`` samples) is routed once, together;
aborts and everything else about a request go to the core that owns it (``owner``).
Dead cores are never chosen. The router is plain Python, single-threaded (the caller's lock or
event loop), and knows nothing of processes: ``DPClient`` feeds it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["CoreLoad", "DPRouter", "prefix_keys"]

#: vLLM's weight of a waiting request against a running one in the load score.
WAITING_WEIGHT = 4


@dataclass(slots=True)
class CoreLoad:
    """One engine core's load as the router sees it."""

    reported_waiting: int = 0
    reported_running: int = 0
    unreported: int = 0  # requests routed here since the core's last stats
    alive: bool = True

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * (self.reported_waiting + self.unreported) + self.reported_running


def prefix_keys(token_ids: Sequence[int], block_size: int, max_blocks: int,
                root: object = None) -> list[int]:
    """Chained hashes of the prompt's first ``max_blocks`` full blocks (shortest first).
    ``root``: what else separates KV (LoRA adapter, cache salt, image hashes)."""
    keys: list[int] = []
    parent = hash(("llmkit-dp", root))
    n_full = min(len(token_ids) // block_size, max_blocks)
    for i in range(n_full):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


class DPRouter:
    """Picks an engine core per request (see the module docstring for the rule)."""

    def __init__(self, num_cores: int, *, block_size: int = 16, affinity_blocks: int = 4,
                 affinity_slack: int = 8, affinity_ratio: float = 0.5,
                 max_prefix_entries: int = 65536) -> None:
        if num_cores < 1:
            raise ValueError("a router needs at least one engine core")
        self.cores = [CoreLoad() for _ in range(num_cores)]
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.affinity_slack = affinity_slack
        self.affinity_ratio = affinity_ratio
        self.max_prefix_entries = max_prefix_entries
        self._prefix_owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> core
        self._owner: dict[str, int] = {}  # engine request id -> core
        # Counters (for logs and tests): requests sent to their preferred core, and those
        # that left it because it was too busy.
        self.num_affinity_hits = 0
        self.num_affinity_fallbacks = 0

    # -- the choice -------------------------------------------------------------------------
    def least_loaded(self) -> int:
        live = [i for i, c in enumerate(self.cores) if c.alive]
        if not live:
            raise RuntimeError("no engine core is alive")
        return min(live, key=lambda i: (self.cores[i].score, i))

    def choose(self, keys: Sequence[int] = ()) -> int:
        """The core for a request whose prefix keys are ``keys`` (no state changes)."""
        least = self.least_loaded()
        preferred = self._preferred(keys)
        if preferred is None or preferred == least:
            return least
        if self._close_enough(self.cores[preferred].score, self.cores[least].score):
            return preferred
        return least

    def _preferred(self, keys: Sequence[int]) -> int | None:
        for key in reversed(keys):  # the longest remembered prefix wins
            core = self._prefix_owner.get(key)
            if core is not None and self.cores[core].alive:
                return core
        return None

    def _close_enough(self, preferred_score: int, least_score: int) -> bool:
        slack = max(self.affinity_slack, self.affinity_ratio * least_score)
        return preferred_score - least_score <= slack

    def route(self, request_ids: Iterable[str], keys: Sequence[int] = ()) -> int:
        """Choose a core for one user request (all its engine requests) and record it."""
        ids = list(request_ids)
        preferred = self._preferred(keys)
        core = self.choose(keys)
        if preferred is not None:
            if core == preferred:
                self.num_affinity_hits += 1
            else:
                self.num_affinity_fallbacks += 1
        self.assign(ids, core, keys)
        return core

    def assign(self, request_ids: Iterable[str], core: int, keys: Sequence[int] = ()) -> None:
        """Record that ``core`` serves these engine requests (and now owns their prefix)."""
        load = self.cores[core]
        for rid in request_ids:
            self._owner[rid] = core
            load.unreported += 1
        for key in keys:
            self._prefix_owner[key] = core
            self._prefix_owner.move_to_end(key)
        while len(self._prefix_owner) > self.max_prefix_entries:
            self._prefix_owner.popitem(last=False)

    # -- what the cores tell ----------------------------------------------------------------
    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def owned_by(self, core: int) -> list[str]:
        return [rid for rid, c in self._owner.items() if c == core]

    def finished(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._owner.pop(rid, None)

    def report(self, core: int, num_waiting: int, num_running: int) -> None:
        """A core's scheduler counts after a step (or an abort)."""
        load = self.cores[core]
        load.reported_waiting = num_waiting
        load.reported_running = num_running
        load.unreported = 0

    def revive(self, core: int) -> None:
        """A new process serves as ``core``: idle, alive, owning nothing yet."""
        self.cores[core] = CoreLoad()

    def mark_dead(self, core: int) -> list[str]:
        """The core is gone: it is never chosen again; returns the requests it owned."""
        self.cores[core].alive = False
        lost = self.owned_by(core)
        self.finished(lost)
        for key in [k for k, c in self._prefix_owner.items() if c == core]:
            del self._prefix_owner[key]
        return lost
