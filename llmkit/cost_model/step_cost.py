"""What one engine step costs on modelled hardware: a roofline with per-step overheads.

A step is what the scheduler hands the runner: for each scheduled request ``i``, ``q_i`` new
tokens whose K/V it computes, ``c_i`` the request's context after the step (cached + new), and
whether it samples a token (its computed tokens reach the end of what it holds). With the model
shape (``L`` layers, hidden ``h``, ``n_h`` query heads of ``d`` dims, vocabulary ``V``, ``P``
parameters a token multiplies by per layer, ``κ`` KV bytes per token per rank) and the device
(peak FLOP/s ``F`` for the dtype, bandwidth ``B``, efficiencies ``η_c``, ``η_m``, ``η_l``), on each
of ``p`` tensor-parallel ranks::

    T = Σ q_i                                   tokens in the step
    S = #{i samples}                            rows of logits
    A = Σ [ q_i (c_i − q_i) + q_i (q_i + 1) / 2 ]   causal query–key pairs
    FLOPs   = [ 2·T·L·P  +  2·S·V·h  +  4·L·n_h·d·A ] / p        matmuls, LM head, QKᵀ and PV
    bytes   = [ L·P_read(T) + V·h·[S>0] + T·h ]·b_w / p           weights streamed once a step
            + Σ (c_i + q_i) · κ                                   KV read (whole context) + written
    compute = FLOPs / (F · η_c)
    memory  = bytes / (B · η_m)
    comm    = 2·L · [ α + 2(p−1)/p · T·h·b_a / (B_link · η_l) ]     p > 1: two ring all-reduces
                                                                  per layer (attention, MLP)
    base    = max(compute, memory) + comm + t_step + L·t_layer
              + n·t_seq + T·t_token + C·t_context          n requests, C = Σ c_i
              + t_eager · [eager]
    step    = base / (1 − min(0.9, c_fe · R))              R: tokens/s the front end streams

**KV-cache specs** (``llmkit.cost_model.kv_footprint``): the KV terms above are for full
attention. Each layer prices its own spec: a sliding-window layer reads only the keys its
queries see (``min(c_i, q_i + W − 1)`` rows, and ``Σ min(j, W)`` pairs), an MLA layer reads one
latent row per token (``κ`` from ``kv_lora_rank + qk_rope_head_dim``) and its pairs cost
``2·n_h·(2r + d_rope)`` (absorbed), a recurrent layer reads and writes its fixed state once per
request (``2·S``) and has no pairs::

    bytes_KV = Σ_groups layers_g · Σ_i [ rows_g(q_i, c_i) · κ_g + 2·S_g ]
    FLOPs_attn = Σ_groups layers_g · φ_g · Σ_i pairs_g(q_i, c_i) / p

**Pipeline parallel** (``pipeline_parallel_size`` ``s`` > 1): the layers split into stages as
the engine splits them (``get_pp_indices``); stage ``k`` computes its ``L_k`` layers with the
terms above (the first also the embedding gather, the last the LM head), and between stages the
hidden states and residual cross the link::

    stage_k  = max(compute_k, memory_k) + comm_k + L_k·t_layer + (L_k/L)·(T·t_token + C·t_context)
    transfer = α + 2·T·h·b_a / (B_link · η_l)
    engine   = t_step + n·t_seq                  the engine's CPU work, once per batch
    step     = engine + Σ_k stage_k + (s − 1)·transfer      one batch alone through the pipe

A batch alone leaves every stage but one idle (the bubble); the sim executor keeps up to ``s``
batches in flight, as the engine's batch queue does, and times them on one clock per stage
(``llmkit.tools.sim.executor``), so overlap and bubbles follow from the schedule.

``P_read(T)`` is every parameter of a layer for a dense model; for a mixture of experts only
the experts some token routes to (``E·(1 − (1 − k/E)^T)`` in expectation). The embedding is a
gather (``T·h`` elements), not a stream. Activations' own traffic and the sampler are left out
(small next to weights and KV at serving batch sizes). ``t_step`` (CPU: schedule, prepare
inputs, sample) and ``t_layer`` (short kernels per layer) come from the hardware profile, as do
all efficiencies: they are fixed per profile and never fitted to a workload.

``t_seq`` (per request in the step: its input rows, sampling, output handling), ``t_token`` (per
token computed: the part of small-M GEMMs and per-token ops that runs below the roofline and
does not overlap it) and ``t_context`` (per token of context attended: a CPU's paged decode
attention costs more per KV token than its bytes at the bandwidth) are 0 on GPU profiles; ``llmkit
sim calibrate engine`` fits them, with ``η_c``, ``η_m``, ``t_step`` and ``t_layer``, from timed
steps of the real engine on this machine (``llmkit.tools.sim.engine_fit``). ``c_fe``
(``frontend_token_us``, 0 on GPU profiles) is the engine CPU time that a front end sharing its
cores (API server, detokenisation, a benchmark client) takes per token it streams, so at ``R``
tokens/s it holds a share ``c_fe·R`` of the CPU; ``sim calibrate engine
sim.calibrate_trace=PATH`` fits it to a served run (``llmkit.tools.sim.frontend_cost``, which also
keeps ``R`` for the simulator). It is added to ``overhead_s``.

``t_eager`` (``eager_step_overhead_ms``, 0 on GPU profiles): a CPU engine runs a decode step of
up to ``step_graph_max_rows`` rows (every row one new token) as a compiled step graph, every
other step (a prefill row, a verify row, more rows; or ``step_graphs=False``, the engine's
``compilation.mode=eager``) eagerly, op by op from Python; ``[eager]`` is 1 for those steps.
Fitted by ``llmkit sim calibrate engine``: without it the linear terms averaged a 9-row decode
step with an 8-row one and prefill steps with decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from llmkit.cost_model.hardware import HardwareProfile
from llmkit.cost_model.model_shape import ModelShape, dtype_bytes
from llmkit.distributed.pipeline import get_pp_indices

__all__ = ["CostModel", "SeqWork", "StepCost"]

# the front end's share of the CPU is capped here: past it the model no longer describes a
# working server
MAX_FRONTEND_SHARE = 0.9


@dataclass(slots=True, frozen=True)
class SeqWork:
    """One request's share of a step."""

    num_new_tokens: int  # q: tokens whose K/V this step computes
    context_len: int  # c: tokens in the request's KV after the step (cached + new)
    samples: bool = True  # the step reaches the end of what the request holds: one logit row


@dataclass(slots=True, frozen=True)
class StepCost:
    """One step's modelled time (seconds) and work (per rank; under pipeline parallel the
    sums over the stages, and flops and bytes per device on average)."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    flops: float
    bytes: float
    num_tokens: int
    num_seqs: int
    # pipeline parallel: each stage's time, the stage-to-stage transfer, the engine's part
    stage_s: tuple[float, ...] = ()
    transfer_s: float = 0.0
    engine_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The step's latency (a pipelined batch alone: through every stage in turn)."""
        if self.stage_s:
            return (self.engine_s + sum(self.stage_s)
                    + (len(self.stage_s) - 1) * self.transfer_s)
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


_EMPTY = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)


class CostModel:
    def __init__(self, shape: ModelShape, hardware: HardwareProfile, dtype: str,
                 tensor_parallel_size: int = 1, kv_dtype: str | None = None,
                 pipeline_parallel_size: int = 1, step_graphs: bool = True) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if not 1 <= pipeline_parallel_size <= shape.num_layers:
            raise ValueError(f"pipeline_parallel_size must be between 1 and the model's "
                             f"{shape.num_layers} layers, got {pipeline_parallel_size}")
        if tensor_parallel_size * pipeline_parallel_size > 1 and hardware.link_bandwidth <= 0:
            raise ValueError(f"hardware {hardware.name!r} has no link (link_bandwidth_gbs=0): "
                             "tensor or pipeline parallelism cannot be modelled on it")
        self.shape = shape
        self.hw = hardware
        self.dtype = dtype
        self.tp = tensor_parallel_size
        self.pp = pipeline_parallel_size
        self.stage_layers = tuple(e - b for b, e in (
            get_pp_indices(shape.num_layers, k, self.pp) for k in range(self.pp)))
        # Quantized weights still compute and keep K/V in 16 bits unless told otherwise.
        self.kv_dtype = kv_dtype or ("bfloat16" if dtype in ("fp8", "int8") else dtype)
        self.b_w = dtype_bytes(dtype)
        self.b_act = dtype_bytes("bfloat16") if dtype in ("fp8", "int8") else self.b_w
        self.peak_flops = hardware.peak(dtype)
        # every layer's KV state on one TP rank, by spec (under PP a device holds its stage's
        # layers only); kv_bytes_per_token: what one more token costs inside every window
        self.kv = shape.kv_footprint(self.kv_dtype, self.tp)
        self.kv_bytes_per_token = int(self.kv.kv_bytes_per_token)
        s = shape
        self._flops_per_token = 2.0 * s.num_layers * s.active_layer_params()
        self._flops_per_logit_row = 2.0 * s.vocab_size * s.hidden_size
        # per stage: how many layers of each KV group it holds
        self._stage_groups = []
        begin = 0
        for n in self.stage_layers:
            self._stage_groups.append(self.kv.stage_counts(begin, begin + n))
            begin += n
        self._compute_rate = self.peak_flops * hardware.compute_efficiency
        self._memory_rate = hardware.memory_bandwidth * hardware.memory_efficiency
        self._overhead_s = hardware.step_overhead_s + s.num_layers * hardware.layer_overhead_s
        self._link_rate = hardware.link_bandwidth * hardware.link_efficiency
        self._seq_s = hardware.seq_overhead_s
        self._token_s = hardware.token_overhead_s
        self._context_s = hardware.context_overhead_s
        self._frontend_token_s = hardware.frontend_token_s
        self._eager_s = hardware.eager_step_s
        # decode steps of up to this many rows run as a graph (0: none does)
        self._graph_rows = hardware.step_graph_max_rows if step_graphs else 0

    # -- figures of the model on the device -----------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Every parameter of the checkpoint in ``dtype`` (all ranks together)."""
        return self.shape.weight_bytes(self.dtype)

    @property
    def max_stage_fraction(self) -> float:
        """The largest stage's share of the layers (1 without pipeline parallel)."""
        return max(self.stage_layers) / self.shape.num_layers

    @property
    def weight_bytes_per_device(self) -> float:
        """The weights one device holds: its TP share of the largest stage's layers."""
        return self.weight_bytes / self.tp * self.max_stage_fraction

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        return self.kv_bytes_per_token * self.max_stage_fraction

    def weight_read_time_s(self, at_peak: bool = True) -> float:
        """Time to stream all weights once (each rank its 1/p share) at the peak bandwidth, or
        at the achieved one (``at_peak=False``)."""
        rate = self.hw.memory_bandwidth * (1.0 if at_peak else self.hw.memory_efficiency)
        return self.weight_bytes / self.tp / rate

    # -- one step ---------------------------------------------------------------------------
    def step(self, work: Iterable[SeqWork | tuple[int, int, bool]],
             stream_rate: float = 0.0) -> StepCost:
        """The cost of one step; ``stream_rate``: tokens/s the front end is streaming (the
        profile's ``frontend_token_s`` prices them)."""
        T = S = n = 0
        attended = 0
        multi = False  # a row computes more than one token: no step graph runs it
        groups = self.kv.groups
        # per KV group, for one of its layers: bytes read and written, FLOPs of attention
        kv_bytes = [0.0] * len(groups)
        attn_flops = [0.0] * len(groups)
        for w in work:
            q, c, samples = (w.num_new_tokens, w.context_len, w.samples) \
                if isinstance(w, SeqWork) else w
            if q <= 0:
                continue
            n += 1
            T += q
            multi = multi or q > 1
            S += 1 if samples else 0
            attended += c
            for k, g in enumerate(groups):
                # the keys its queries see are read, the new rows written; a state both
                kv_bytes[k] += g.step_rows(q, c) * g.bytes_per_token + 2 * g.state_bytes
                attn_flops[k] += g.pairs(q, c) * g.flops_per_pair
        if T == 0:
            return _EMPTY
        share = min(MAX_FRONTEND_SHARE, self._frontend_token_s * stream_rate)
        hw = self.hw
        eager = self._eager_s if multi or n > self._graph_rows else 0.0
        engine = hw.step_overhead_s + n * self._seq_s + eager
        stages = [self._stage(T, S, self._by_group(kv_bytes, k), self._by_group(attn_flops, k),
                              attended, layers, k == 0, k == self.pp - 1)
                  for k, layers in enumerate(self.stage_layers)]
        if self.pp == 1:
            compute_s, memory_s, comm, _, flops, nbytes = stages[0]
            overhead = self._overhead_s + n * self._seq_s + T * self._token_s + \
                attended * self._context_s + eager
            if share > 0:
                overhead += (max(compute_s, memory_s) + comm + overhead) * share / (1.0 - share)
            return StepCost(compute_s=compute_s, memory_s=memory_s, comm_s=comm,
                            overhead_s=overhead, flops=flops, bytes=nbytes, num_tokens=T,
                            num_seqs=n)
        transfer = hw.link_latency_s + 2.0 * T * self.shape.hidden_size * self.b_act / \
            self._link_rate
        stage_s = tuple(max(c, m) + comm + o for c, m, comm, o, _, _ in stages)
        if share > 0:
            latency = engine + sum(stage_s) + (self.pp - 1) * transfer
            engine += latency * share / (1.0 - share)
        return StepCost(
            compute_s=sum(x[0] for x in stages), memory_s=sum(x[1] for x in stages),
            comm_s=sum(x[2] for x in stages) + (self.pp - 1) * transfer,
            overhead_s=engine + sum(x[3] for x in stages),
            flops=sum(x[4] for x in stages) / self.pp, bytes=sum(x[5] for x in stages) / self.pp,
            num_tokens=T, num_seqs=n, stage_s=stage_s, transfer_s=transfer, engine_s=engine)

    def _by_group(self, per_layer: list[float], stage: int) -> float:
        """A per-layer figure of each KV group summed over the stage's layers."""
        return sum(x * n for x, n in zip(per_layer, self._stage_groups[stage]))

    def _stage(self, T: int, S: int, kv_bytes: float, attn_flops: float, attended: int,
               layers: int, first: bool, last: bool
               ) -> tuple[float, float, float, float, float, float]:
        """``(compute_s, memory_s, comm_s, overhead_s, flops, bytes)`` of ``layers`` layers on
        one TP rank (the first stage gathers the embedding, the last computes the LM head);
        ``kv_bytes`` and ``attn_flops`` are already the stage's, on one rank."""
        s, p, L = self.shape, self.tp, self.shape.num_layers
        f = layers / L
        flops = (f * self._flops_per_token * T + (self._flops_per_logit_row * S if last else 0.0)
                 ) / p + attn_flops
        weights = (layers * s.layer_params_read(T) + (s.lm_head_params if S and last else 0)
                   + (T * s.hidden_size if first else 0)) * self.b_w / p
        nbytes = weights + kv_bytes
        comm = 0.0
        if p > 1:
            msg = T * s.hidden_size * self.b_act
            one = self.hw.link_latency_s + 2.0 * (p - 1) / p * msg / self._link_rate
            comm = 2 * layers * one
        overhead = layers * self.hw.layer_overhead_s + f * (T * self._token_s
                                                            + attended * self._context_s)
        return (flops / self._compute_rate, nbytes / self._memory_rate, comm, overhead, flops,
                nbytes)

    def decode_step(self, batch_size: int, context_len: int) -> StepCost:
        """``batch_size`` requests each decoding one token with ``context_len`` tokens of
        context (including the new one)."""
        return self.step([SeqWork(1, context_len, True)] * batch_size)

    def prefill_step(self, prompt_lens: Sequence[int]) -> StepCost:
        """Whole prompts in one step (each samples its first token)."""
        return self.step([SeqWork(n, n, True) for n in prompt_lens])

    def describe(self) -> dict:
        """The constants the equations use (for the result file)."""
        s, hw = self.shape, self.hw
        return {
            "dtype": self.dtype, "kv_dtype": self.kv_dtype, "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp, "stage_layers": list(self.stage_layers),
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token,
            "kv_state_bytes_per_request_per_rank": self.kv.state_bytes_per_request,
            "flops_per_token": self._flops_per_token,
            "peak_flops": self.peak_flops, "compute_efficiency": hw.compute_efficiency,
            "memory_bandwidth": hw.memory_bandwidth, "memory_efficiency": hw.memory_efficiency,
            "link_bandwidth": hw.link_bandwidth, "link_latency_s": hw.link_latency_s,
            "link_efficiency": hw.link_efficiency,
            "step_overhead_s": hw.step_overhead_s, "layer_overhead_s": hw.layer_overhead_s,
            "overhead_per_step_s": self._overhead_s,
            "seq_overhead_s": hw.seq_overhead_s, "token_overhead_s": hw.token_overhead_s,
            "context_overhead_s": hw.context_overhead_s,
            "frontend_token_s": hw.frontend_token_s,
            "eager_step_s": hw.eager_step_s, "step_graph_max_rows": self._graph_rows,
            "weight_read_time_at_peak_s": self.weight_read_time_s(True),
            "num_layers": s.num_layers,
        }
