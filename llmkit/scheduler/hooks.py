"""Named hooks through which optional features join the token-budget scheduler.

LoRA slots, draft tokens, EAGLE's prefix rule, images, grammars and a KV connector each
subclass ``SchedulerFeature`` and override only the hooks they need. ``FeatureHooks`` keeps, per
hook, the bound methods of the features that override it, so the scheduler walks a hook's
features only: a feature that is off is not registered, and a hook no feature uses is an empty
tuple. Features register when they are turned on: at construction (a LoRA slot limit, EAGLE, a
KV connector) or on first use (the first request with images or a grammar, the first drafts).

Hooks of a point run in the fixed order of ``FEATURE_ORDER`` (LoRA before images, drafts before
grammars), whatever the order the features were turned on in, so the decisions do not depend on
which request came first; other features (a subclass's own, added with
``TokenBudgetScheduler.add_feature``) run after those, in the order they were added.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from llmkit.request import Request, RequestStatus

if TYPE_CHECKING:
    from llmkit.kv_cache.block_pool import KVCacheBlock
    from llmkit.outputs import EngineCoreOutput, ModelRunnerOutput
    from llmkit.scheduler.base import SchedulerOutput, SchedulerStats
    from llmkit.scheduler.step_phases import WaitingQueue

# ``pass_over`` verdicts for a waiting request.
ADMIT, PASS_OVER, PASS_OVER_AND_STOP = 0, 1, 2

FEATURE_ORDER = ("lora", "eagle", "encoder", "drafts", "grammar", "connector")


class FeatureHost(Protocol):
    """What a feature may use of the scheduler it joins."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: WaitingQueue

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """End ``req`` (its blocks freed unless a feature keeps them)."""

    def report_finished(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` outside a step's results; its output goes with the next update."""

    def check_stop(self, req: Request, tok: int) -> bool:
        """Apply the stop conditions after ``tok`` was appended; True if ``req`` ended."""


class SchedulerFeature:
    """One optional feature's part in scheduling; each method is a hook (the defaults do
    nothing and are never called: only overridden hooks are registered)."""

    name: str = ""

    # -- intake ------------------------------------------------------------------------------
    def check_request(self, req: Request) -> None:
        """Raise if the new request could never be served."""

    def hold_request(self, req: Request) -> bool:
        """Whether the feature keeps the new request in a state of its own (a grammar that
        compiles) instead of the waiting queue; it queues the request later itself."""
        return False

    def drop_held(self, req: Request) -> bool | None:
        """An aborted request in a state of this feature's: whether its blocks are freed now
        (None: not held here)."""
        return None

    # -- a step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a step: reset the step's own state, release held requests that may run."""

    def step_budget(self, budget: int) -> int:
        """The step's token budget (of ``budget``, at first ``max_num_batched_tokens``)."""
        return budget

    def limit_running(self, req: Request, n: int) -> int:
        """The tokens (of ``n``) a running request may compute this step."""
        return n

    def extra_tokens(self, req: Request, n: int, budget: int) -> int:
        """Tokens a running request verifies on top of its ``n`` (draft tokens)."""
        return 0

    def pass_over(self, req: Request) -> int:
        """For the head of the waiting queue: ADMIT, PASS_OVER (later requests may go ahead)
        or PASS_OVER_AND_STOP (nothing behind it is admitted this step)."""
        return ADMIT

    def holds_kv(self, req: Request) -> bool:
        """Whether a waiting request's KV was brought in already (it holds its blocks)."""
        return False

    def trim_prefix_hit(self, blocks: list[KVCacheBlock], num_hit: int
                        ) -> tuple[list[KVCacheBlock], int]:
        """The prefix-cache hit a waiting request is admitted with."""
        return blocks, num_hit

    def match_external(self, req: Request, num_hit: int) -> tuple[int, bool]:
        """(tokens brought from outside past the local hit, whether they load asynchronously)."""
        return 0, False

    def limit_admission(self, req: Request, start: int, n: int) -> int:
        """The tokens (of ``n``, from ``start``) a waiting request may compute this step; a
        negative count ends this step's admissions."""
        return n

    def parked(self, req: Request, lookup: bool, num_hit: int, num_ext: int,
               load_async: bool) -> bool:
        """A waiting request got its blocks: whether it now waits for its KV instead of
        running."""
        return False

    def not_scheduled(self, req: Request) -> None:
        """The request was limited or planned for but does not run this step."""

    def admitted(self, req: Request) -> None:
        """A waiting request runs from this step on."""

    def scheduled(self, req: Request, n: int) -> None:
        """The request computes ``n`` tokens this step (its num_computed_tokens not counted
        yet)."""

    def preempted(self, req: Request) -> None:
        """A running request was preempted (its KV is recomputed later)."""

    def end_step(self, out: SchedulerOutput) -> None:
        """Fill the step's output fields this feature owns."""

    def busy(self) -> bool:
        """Whether work this feature tracks may free blocks later (a request that does not fit
        now is then not refused)."""
        return False

    # -- results -----------------------------------------------------------------------------
    def begin_update(self, runner_output: ModelRunnerOutput) -> None:
        """Before a step's results are applied."""

    def computed(self, req: Request) -> None:
        """The request's scheduled tokens of the step just run are computed."""

    def verify(self, req: Request, new_tokens: list[int], out: SchedulerOutput) -> None:
        """The request sampled ``new_tokens`` (verifying its drafts, if it had any)."""

    def accept_tokens(self, req: Request, new_tokens: list[int], now: float
                      ) -> list[int] | None:
        """Append the request's sampled tokens itself, applying the stop conditions; the
        tokens kept (None: the scheduler appends them)."""
        return None

    def finished(self, req: Request, free_blocks: bool) -> bool:
        """The request ended: whether its blocks are freed now."""
        return free_blocks

    def final_output(self, req: Request, out: EngineCoreOutput) -> None:
        """Complete a finished request's last output."""

    # -- introspection -----------------------------------------------------------------------
    def num_held(self) -> int:
        """Requests in this feature's own waiting state (counted as waiting)."""
        return 0

    def holds_work(self) -> bool:
        """Whether the engine must keep stepping though no request is unfinished."""
        return False

    def fill_stats(self, stats: SchedulerStats) -> None:
        """Fill the stats fields this feature owns."""


_HOOKS = tuple(name for name, value in vars(SchedulerFeature).items()
               if callable(value) and not name.startswith("_"))


class FeatureHooks:
    """Per hook (an attribute of the hook's name), the bound methods of the registered
    features that override it, in ``FEATURE_ORDER``."""

    __slots__ = _HOOKS

    def __init__(self, features: dict[str, SchedulerFeature]) -> None:
        rank = {name: i for i, name in enumerate(FEATURE_ORDER)}
        ordered = sorted(features.values(), key=lambda f: rank.get(f.name, len(rank)))
        for name in _HOOKS:
            setattr(self, name, tuple(
                getattr(f, name) for f in ordered
                if getattr(type(f), name) is not getattr(SchedulerFeature, name)))
