"""``executor=sim``: no weights, no forward — each step costs what the cost model says.

The engine core, its scheduler and its KV cache manager are the real ones; only the data plane
is replaced. For every ``SchedulerOutput`` the executor

1. works out each scheduled request's share of the step: new tokens ``q``, context after the
   step ``c``, and whether the step reaches the end of what the request holds (then it samples);
2. prices the step with ``llmkit.cost_model.step_cost.CostModel`` for the ``hardware`` profile (with
   the tokens/s streamed lately, which a CPU profile's front-end term charges for) and advances
   the virtual clock (if it was given one) by that time;
3. returns one sampled token per sampling request, drawn from a seeded RNG over the vocabulary
   without the EOS ids and the request's ``stop_token_ids``. So a request never stops early: it
   ends at its ``max_tokens`` (or ``max_model_len``), i.e. output lengths follow the workload,
   as ``bench serve`` with ``ignore_eos`` (its default) makes a real server do.

With ``speculative=...`` (the same group a real engine reads) a request verifying drafts gains
its accepted drafts plus one token, by the acceptance model, and every sampling request gets
drafts for the next step, as many as the engine's draft-length policy allows
(``llmkit.tools.sim.speculation``); the scheduler schedules them as it would a proposer's, so a
verify step costs what 1 + K tokens per row cost, and a draft model's passes are added.

With ``parallel.pipeline_parallel_size`` = ``s`` > 1 the executor keeps up to ``s`` steps in
flight (``max_concurrent_batches``, as the real engine's batch queue): each step enters a
timeline with one clock for the engine's CPU work and one per stage, waits for each stage to
be free, crosses the link between stages, and is done when the last stage is; taking its result
moves the virtual clock to then. A lone batch leaves the other stages idle (the bubble); the
scheduler's interleaved batches fill them.

The KV pool follows from the hardware: ``memory × sim.gpu_memory_utilization − weights / p −
activations`` per rank, in blocks (``num_kv_blocks()``). A model whose layers keep other state
than full attention (sliding windows, MLA's latent, recurrent states: its KV-cache specs,
read from its config) gets the pool layout a real runner plans for it
(``llmkit.worker.kv_cache_setup.plan_kv_cache``: its groups, block size and bytes per block),
and the engine core runs the same KV cache manager on it as on a real engine (the hybrid one
for several groups: windows free their blocks, a state holds one block per request), so the
simulated capacity is the engine's. ``llmkit sim`` sets
``kv_cache.num_blocks`` to it unless the user set one; an ``EngineCore`` built with
``executor=sim`` by hand uses ``kv_cache.num_blocks`` / ``kv_cache.memory_gib`` as usual.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any, Callable

from llmkit.config.schema import EngineConfig
from llmkit.cost_model.hardware import HardwareProfile
from llmkit.cost_model.step_cost import CostModel, StepCost
from llmkit.executor.base import BackendInfo, DoneFuture, Executor, ModelFacts, StepFuture
from llmkit.outputs import ModelRunnerOutput
from llmkit.scheduler.base import SchedulerOutput
from llmkit.tools.schema import SimToolConfig
from llmkit.tools.sim.frontend_cost import StreamRate
from llmkit.tools.sim.hardware import resolve_hardware
from llmkit.tools.sim.source import SimModel, resolve_sim_dtype, resolve_sim_model
from llmkit.tools.sim.speculation import SimSpeculation

__all__ = ["SimExecutor", "SimStats"]

logger = logging.getLogger(__name__)


class SimStats:
    """Totals over the steps the executor priced (virtual seconds, per rank)."""

    __slots__ = ("steps", "busy_s", "compute_s", "memory_s", "comm_s", "overhead_s", "flops",
                 "bytes", "tokens", "compute_bound_steps", "max_step_s")

    def __init__(self) -> None:
        self.steps = 0
        self.busy_s = self.compute_s = self.memory_s = self.comm_s = self.overhead_s = 0.0
        self.flops = self.bytes = 0.0
        self.tokens = 0
        self.compute_bound_steps = 0
        self.max_step_s = 0.0

    def add(self, c: StepCost) -> None:
        t = c.total_s
        self.steps += 1
        self.busy_s += t
        self.compute_s += c.compute_s
        self.memory_s += c.memory_s
        self.comm_s += c.comm_s
        self.overhead_s += c.overhead_s
        self.flops += c.flops
        self.bytes += c.bytes
        self.tokens += c.num_tokens
        self.compute_bound_steps += c.compute_s >= c.memory_s
        self.max_step_s = max(self.max_step_s, t)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


def default_settings(config: EngineConfig) -> SimToolConfig:
    """The simulator's settings when an engine is built with ``executor=sim`` alone: the
    composed defaults (``conf/tools/tools.yaml``'s ``hardware`` and ``sim``) around
    ``config``."""
    from llmkit.tools.compose import compose_tool_config

    return compose_tool_config(SimToolConfig).model_copy(update={"engine": config})


# kv_cache.cache_dtype -> the cost model's KV dtype (auto: the cost model's default)
_KV_DTYPE = {"fp8_e4m3": "fp8", "fp8": "fp8", "int8": "int8", "bfloat16": "bfloat16",
             "float16": "float16"}


def _tensor_parallel_size(config: EngineConfig, settings: SimToolConfig) -> int:
    """The engine's ``parallel.tensor_parallel_size``; ``sim.tensor_parallel_size`` (the older
    key) still counts when the engine's is 1."""
    from llmkit.config.errors import ConfigError

    engine_tp = config.parallel.tensor_parallel_size
    sim_tp = settings.sim.tensor_parallel_size
    if engine_tp > 1 and sim_tp > 1 and engine_tp != sim_tp:
        raise ConfigError("parallel.tensor_parallel_size", engine_tp,
                          f"sim.tensor_parallel_size ({sim_tp}) or leave one of them at 1")
    return max(engine_tp, sim_tp)


def _pipeline_parallel_size(config: EngineConfig, num_layers: int) -> int:
    from llmkit.config.errors import ConfigError

    pp = config.parallel.pipeline_parallel_size
    if pp > num_layers:
        raise ConfigError("parallel.pipeline_parallel_size", pp,
                          f"at most the model's {num_layers} layers (one per stage)")
    if pp > 1 and config.speculative.enabled:
        raise ConfigError("speculative.name", config.speculative.name,
                          f"none with parallel.pipeline_parallel_size={pp} (the engine does "
                          "not run speculative decoding across pipeline stages)")
    return pp


class SimExecutor(Executor):
    """``settings``: the ``llmkit sim`` config (``hardware``, ``sim.*``) of this engine; unset,
    the composed defaults (``default_settings``)."""

    def __init__(self, config: EngineConfig, platform: Any, *,
                 clock: Callable[[], float] | None = None, model: SimModel | None = None,
                 hardware: HardwareProfile | None = None,
                 settings: SimToolConfig | None = None) -> None:
        super().__init__(config, platform)
        if settings is None:
            settings = default_settings(config)
        self.settings = settings
        self.model = model or resolve_sim_model(settings)
        self.hardware = hardware or resolve_hardware(settings)
        # model.mla=expanded keeps K and V per head, not the latent
        shape = self.model.shape.with_mla(config.model.mla)
        if shape is not self.model.shape:
            self.model = dataclasses.replace(self.model, shape=shape)
        self.dtype = resolve_sim_dtype(settings, shape, self.hardware)
        tp = _tensor_parallel_size(config, settings)
        pp = _pipeline_parallel_size(config, shape.num_layers)
        try:
            self.cost_model = CostModel(shape, self.hardware, self.dtype, tp,
                                        kv_dtype=_KV_DTYPE.get(config.kv_cache.cache_dtype),
                                        pipeline_parallel_size=pp,
                                        # compilation.mode=eager: every step runs eagerly
                                        step_graphs=config.compilation.mode == "graphs")
        except (KeyError, ValueError) as e:
            from llmkit.config.errors import ConfigError
            raise ConfigError("hardware", self.hardware.name, "", message=str(e).strip("'\"")
                              ) from None
        # Anything with advance(seconds) (a VirtualClock); None: price steps, move no clock.
        self.clock = clock
        eos = self.model.eos_token_ids
        self._facts = ModelFacts(max_model_len=self.model.max_model_len,
                                 vocab_size=shape.vocab_size,
                                 eos_token_id=eos[0] if eos else None,
                                 eos_token_ids=tuple(eos))
        self._banned = frozenset(eos)
        self._rng = random.Random(f"llmkit-sim-{config.seed}")
        self._num_tokens: dict[str, int] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}
        self.num_blocks: int | None = None
        self.stats = SimStats()
        self.last_step: StepCost | None = None
        # tokens/s streamed lately, for the profile's front-end term (needs the clock's time)
        self._stream = StreamRate()
        # Pipeline parallel: when the engine's CPU and each stage are next free (virtual s).
        self._engine_free = 0.0
        self._stage_free = [0.0] * pp
        self.speculation = (SimSpeculation(config.speculative, self.cost_model, self.hardware,
                                           self.dtype, config.seed)
                            if config.speculative.enabled else None)
        # A model with other KV-cache specs than full attention: the runner's pool layout.
        self.kv_plan = self._plan_kv_cache()
        if self.kv_plan is not None:
            self._facts = dataclasses.replace(self._facts,
                                              kv_cache_groups=self.kv_plan.groups,
                                              kv_block_size=self.kv_plan.block_size)

    def _plan_kv_cache(self) -> Any:
        """The pool layout a runner on one of the ranks would plan for this model's specs
        (None for full attention in every layer: the one-table path)."""
        from llmkit.attention.base import AttentionBackend
        from llmkit.cost_model.kv_footprint import TORCH_DTYPES, rank_specs
        from llmkit.worker.kv_cache_setup import plan_kv_cache

        cm = self.cost_model
        specs = rank_specs(self.model.shape.layer_kv_specs, cm.tp)
        state_dtype = "bfloat16" if self.dtype in ("fp8", "int8") else self.dtype
        try:
            # every built-in backend's cache is (2, blocks, block_size, heads, head_dim)
            return plan_kv_cache(specs, self.config.kv_cache.block_size,
                                 TORCH_DTYPES[cm.kv_dtype], TORCH_DTYPES[state_dtype],
                                 AttentionBackend)
        except ValueError as e:
            from llmkit.config.errors import ConfigError
            if isinstance(e, ConfigError):
                raise
            raise ConfigError("sim.model", self.model.name, "", message=str(e)) from None

    # -- Executor ---------------------------------------------------------------------------
    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    @property
    def backend_info(self) -> BackendInfo:
        """No kernels run: the cost model prices each step for the hardware profile."""
        return BackendInfo(attention="sim", ops="sim", linear_methods=(), dtype=self.dtype,
                           device=f"{self.hardware.name} x{self.num_devices} (simulated)")

    @property
    def num_devices(self) -> int:
        return self.cost_model.tp * self.cost_model.pp

    def step_cost_model(self) -> CostModel:
        """scheduler=slo predicts with the model that prices the simulated steps."""
        return self.cost_model

    @property
    def max_concurrent_batches(self) -> int:
        return self.cost_model.pp

    @property
    def block_size(self) -> int:
        """Tokens a block holds (the pool layout may raise ``kv_cache.block_size``)."""
        plan = self.kv_plan
        return plan.block_size if plan is not None else self.config.kv_cache.block_size

    def kv_cache_bytes_per_block(self) -> int:
        """One block of every layer on every rank (KV heads replicate when fewer than TP ranks;
        under pipeline parallel each layer lives on one stage)."""
        if self.kv_plan is not None:
            return self.kv_plan.bytes_per_block * self.cost_model.tp
        return (self.config.kv_cache.block_size * self._kv_bytes_per_token
                * self.cost_model.tp)

    @property
    def _block_bytes_per_device(self) -> float:
        """What a block costs the fullest device."""
        if self.kv_plan is not None:
            return float(self.kv_plan.bytes_per_block)
        return self.config.kv_cache.block_size * self._kv_bytes_per_device

    @property
    def _kv_bytes_per_token(self) -> int:
        """Per rank: the target's and, with a draft model or EAGLE head, the draft's."""
        spec = self.speculation
        return self.cost_model.kv_bytes_per_token + (spec.kv_bytes_per_token if spec else 0)

    @property
    def _kv_bytes_per_device(self) -> float:
        """What a token's KV costs the fullest device (its stage's layers)."""
        return self._kv_bytes_per_token * self.cost_model.max_stage_fraction

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        fits = int(self.kv_budget_bytes() // self._block_bytes_per_device)
        if num_blocks > fits:
            logger.warning("kv_cache.num_blocks=%d is more than %s holds for this model (%d "
                           "blocks): the simulation assumes memory the device does not have",
                           num_blocks, self.hardware.name, fits)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | StepFuture:
        so = scheduler_output
        for rid in so.finished_req_ids:
            self._num_tokens.pop(rid, None)
            self._stop_ids.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._num_tokens.pop(rid, None)
        if not so.num_scheduled_tokens:
            out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            return DoneFuture(out) if non_block else out
        before: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:
            self._num_tokens[nr.req_id] = len(nr.token_ids)
            stop = nr.sampling_params.stop_token_ids
            if stop:
                self._stop_ids[nr.req_id] = frozenset(stop)
            before[nr.req_id] = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            before[rid] = n
        work = []
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        spec = self.speculation
        catch_up: list[tuple[int, int]] = []
        for rid, q in so.num_scheduled_tokens.items():
            c = before[rid] + q
            held = self._num_tokens[rid]
            samples = c >= held
            work.append((q, c, samples))
            req_ids.append(rid)
            drafts = so.scheduled_spec_tokens.get(rid, ())
            if samples:
                gained = 1 + (spec.num_accepted(len(drafts)) if drafts else 0)
                self._num_tokens[rid] = held + gained
                sampled.append([self._draw(rid) for _ in range(gained)])
                catch_up.append((q - len(drafts) + gained, c - len(drafts) + gained))
            else:
                sampled.append([])
                catch_up.append((q, c))
        draft_ids = self._propose(req_ids, sampled) if spec is not None else {}
        now = self.clock() if callable(self.clock) else None
        rate = self._stream.at(now) if now is not None else 0.0
        cost = self.cost_model.step(work, stream_rate=rate)
        if spec is not None and spec.draft_cost is not None:
            drafting = [(len(d), self._num_tokens[r]) for r, d in draft_ids.items()]
            extra = spec.draft_time_s(catch_up, drafting)
            cost = dataclasses.replace(cost, overhead_s=cost.overhead_s + extra)
        self.last_step = cost
        self.stats.add(cost)
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                draft_token_ids=draft_ids)
        if cost.stage_s and now is not None:  # pipeline parallel on a clock
            future = _SimStepFuture(self, out, self._enter_pipeline(now, cost),
                                    sum(len(t) for t in sampled))
            return future if non_block else future.result()
        if self.clock is not None:
            self.clock.advance(cost.total_s)  # type: ignore[attr-defined]
            if now is not None:
                self._stream.add(now + cost.total_s, sum(len(t) for t in sampled))
        return DoneFuture(out) if non_block else out

    def _enter_pipeline(self, now: float, cost: StepCost) -> float:
        """When a step sent at ``now`` leaves the last stage: the engine's work for it, then
        each stage as soon as both the step and the stage are free, the link between them."""
        t = self._engine_free = max(now, self._engine_free) + cost.engine_s
        free = self._stage_free
        for k, stage_s in enumerate(cost.stage_s):
            if k:
                t += cost.transfer_s
            t = free[k] = max(t, free[k]) + stage_s
        return t

    def _take(self, future: "_SimStepFuture") -> ModelRunnerOutput:
        self.clock.advance_to(future.done_at)  # type: ignore[attr-defined]
        self._stream.add(future.done_at, future.num_tokens)
        return future.output

    def _propose(self, req_ids: list[str], sampled: list[list[int]]) -> dict[str, list[int]]:
        """Drafts for every request that sampled, as many as the draft-length policy allows
        (never past max_model_len); their ids are random (only their number matters here)."""
        rows = [rid for rid, toks in zip(req_ids, sampled) if toks]
        k = self.speculation.num_drafts(len(rows), len(self._num_tokens))
        if k <= 0:
            return {}
        limit = self.model.max_model_len
        out = {}
        for rid in rows:
            n = min(k, limit - self._num_tokens[rid])
            if n > 0:
                out[rid] = [self._draw(rid) for _ in range(n)]
        return out

    def shutdown(self) -> None:
        self._num_tokens.clear()
        self._stop_ids.clear()

    # -- the simulation's own -----------------------------------------------------------------
    def _draw(self, req_id: str) -> int:
        vocab = self._facts.vocab_size
        stop = self._stop_ids.get(req_id)
        rand = self._rng.random
        while True:
            tok = int(rand() * vocab)
            if tok not in self._banned and (stop is None or tok not in stop):
                return tok

    def activation_bytes(self) -> int:
        """Peak activations of one forward of ``max_num_batched_tokens`` tokens on one rank:
        one layer's live tensors (q, k, v, the MLP's intermediate, two residual-sized buffers)
        plus float32 logits of up to ``max_num_seqs`` rows."""
        s, cm = self.model.shape, self.cost_model
        sched = self.config.scheduler
        t = sched.max_num_batched_tokens
        per_token = (s.q_size + 2 * s.kv_size) // cm.tp + \
            (2 if s.gated_mlp else 1) * s.intermediate_size // cm.tp + 2 * s.hidden_size
        rows = min(t, sched.max_num_seqs)
        return t * per_token * cm.b_act + rows * s.vocab_size * 4

    def kv_budget_bytes(self) -> float:
        """Per rank: usable memory minus this rank's weights and activations."""
        cm = self.cost_model
        usable = self.hardware.memory_bytes * self.settings.sim.gpu_memory_utilization
        return usable - cm.weight_bytes_per_device - self.activation_bytes()

    def num_kv_blocks(self) -> int:
        """KV blocks the device's memory holds after the weights (0 if the weights alone do
        not fit), capped as the engine core caps its own budget: never more than
        ``max_num_seqs`` sequences at ``max_model_len`` need (the rest would be idle)."""
        block, plan = self.block_size, self.kv_plan
        fits = max(0, int(self.kv_budget_bytes() // self._block_bytes_per_device))
        per_seq = -(-self.model.max_model_len // block)
        if plan is not None and plan.num_groups > 1:
            from llmkit.kv_cache.groups import blocks_per_request
            # what one sequence holds over every group, plus the hybrid manager's null block
            per_seq = blocks_per_request(plan.groups, self.model.max_model_len, block) + 1
        return min(fits, per_seq * self.config.scheduler.max_num_seqs)


class _SimStepFuture(StepFuture):
    """A priced step in the pipeline: its output is ready at ``done_at`` (virtual s)."""

    __slots__ = ("_executor", "output", "done_at", "num_tokens")

    def __init__(self, executor: SimExecutor, output: ModelRunnerOutput, done_at: float,
                 num_tokens: int) -> None:
        self._executor = executor
        self.output = output
        self.done_at = done_at
        self.num_tokens = num_tokens

    def result(self) -> ModelRunnerOutput:
        return self._executor._take(self)
