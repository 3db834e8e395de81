"""The tools' configs (``bench``, ``sim``, ``eval``, ``proxy``, ``plan``): each holds an engine
config beside its own sections; and ``ToolsConfig``, what the tools' root
(``conf/tools/tools.yaml``) composes to.

``ToolsConfig`` validates the composed document (the engine's sections and every tool's at the
top level); the engine receives only its ``EngineConfig``, a tool its ``BenchToolConfig`` /
``SimToolConfig`` / ``EvalToolConfig`` / ``ProxyToolConfig``. Every model forbids unknown keys,
as in ``llmkit/config/schema.py``.
"""
from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import ConfigDict, Field, field_validator, model_validator

# the hardware group's schema sits below the cost model; the tools name it from here too
from llmkit.config.hardware_schema import HardwareConfig, HardwareEfficiency  # noqa: F401
from llmkit.config.schema import EngineConfig, SloConfig  # noqa: F401 (slo.*: the engine's too)
from llmkit.config.sections.strict import _Strict

class BenchConfig(_Strict):
    """``llmkit bench serve|throughput|latency|plot`` (definitions:
    ``llmkit/tools/bench/metrics.py``).

    The workload (dataset + arrival times) is built from these fields alone, with ``seed``,
    so the same config replays the same requests (also in the simulator)."""

    # JSON keeps ``rate: inf`` as "Infinity" (which validates back), not null.
    model_config = ConfigDict(ser_json_inf_nan="strings")

    # -- where to send requests (bench serve) ------------------------------------------------
    # null = http://{server.host}:{server.port}
    base_url: str | None = None
    # completions: /v1/completions (token-id prompts allowed); chat: /v1/chat/completions
    endpoint: Literal["completions", "chat"] = "completions"
    # The served model name; null = the first entry of GET /v1/models.
    model: str | None = None
    # Spread the requests over these LoRA adapters (served names; request i uses
    # lora_names[i % len]). bench throughput: names of lora.modules. Empty = the base model.
    lora_names: list[str] = Field(default_factory=list)
    # Bearer token; null = the LLMKIT_API_KEY / OPENAI_API_KEY environment variables.
    api_key: str | None = None
    request_timeout_s: float = Field(default=600.0, gt=0)
    # -- the workload ----------------------------------------------------------------------
    dataset: Literal["random", "shared_prefix", "jsonl"] = "random"
    # jsonl: one {"prompt": str | [ids], "max_tokens": int} per line
    dataset_path: str | None = None
    num_requests: int = Field(default=100, ge=1)
    # Mean prompt / output lengths in tokens; each is drawn uniformly from
    # [mean * (1 - range_ratio), mean * (1 + range_ratio)]. shared_prefix: input_len is the
    # length of each request's distinct suffix.
    input_len: int = Field(default=128, ge=1)
    output_len: int = Field(default=64, ge=1)
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    # shared_prefix: num_prefixes prefixes of prefix_len tokens, request i uses prefix i % k
    num_prefixes: int = Field(default=4, ge=1)
    prefix_len: int = Field(default=256, ge=1)
    # ids: send token ids (exact lengths); text: decode them and send text (for servers that
    # do not accept token-id prompts; lengths then change on re-tokenization)
    prompt_format: Literal["ids", "text"] = "ids"
    # The tokenizer for random / shared_prefix prompts; null = the model's (MODEL / model.path).
    tokenizer: str | None = None
    # -- arrivals ------------------------------------------------------------------------
    # requests/s; inf = all at once
    rate: float = Field(default=float("inf"), gt=0)
    # poisson: exponential gaps of mean 1/rate; constant: exactly 1/rate apart; burst: all at 0
    arrival: Literal["poisson", "constant", "burst"] = "poisson"
    # at most this many requests in flight (null = no cap)
    max_concurrency: int | None = Field(default=None, ge=1)
    # stop after this many seconds: unsent requests are dropped, those in flight cancelled
    max_duration_s: float | None = Field(default=None, gt=0)
    # bench serve: untimed requests sent one by one before the run (a fresh server's first
    # request pays one-off start-up costs); their prompts share no prefix with the workload's
    warmup_requests: int = Field(default=1, ge=0)
    seed: int = 0
    # -- sampling of every request --------------------------------------------------------
    ignore_eos: bool = True
    temperature: float = Field(default=0.0, ge=0)
    # -- offline benchmarks (throughput / latency) ------------------------------------------
    # throughput: also run this baseline on the same model and prompts and print the ratio
    # (latency: llamacpp only)
    baseline: Literal["none", "hf", "llamacpp"] = "none"
    # llamacpp baseline: the folder holding llama-bench and llama-batched-bench (a llama.cpp
    # build's bin/), and llama-bench's repetitions
    llamacpp_bin_dir: str | None = None
    llamacpp_reps: int = Field(default=3, ge=1)
    # hf baseline: prompts sorted by length, in batches of at most this many (padded left)
    hf_batch_size: int = Field(default=32, ge=1)
    # latency: one batch of this many requests, timed num_iters times after the warm-up
    batch_size: int = Field(default=8, ge=1)
    num_iters: int = Field(default=3, ge=1)
    num_iters_warmup: int = Field(default=1, ge=0)
    # -- output ---------------------------------------------------------------------------
    output_dir: str = "bench_results"
    # the result's file stem; null = "<kind>-<swept values>" in a sweep, else "<kind>-<time>"
    result_name: str | None = None
    progress: bool = True

    @model_validator(mode="after")
    def _dataset_needs(self) -> "BenchConfig":
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("bench.dataset_path (a JSONL file) is required when bench.dataset "
                             "is jsonl")
        return self


class ProxyConfig(_Strict):
    """``llmkit proxy``: an OpenAI-compatible front for disaggregated serving
    (``llmkit/tools/proxy.py``). Each request is prefilled on one of ``prefill_urls``
    (``max_tokens=1``, ``kv_transfer_params={"do_remote_decode": true}``) and decoded on one
    of ``decode_urls`` with the producer's ``kv_transfer_params``; both round-robin."""

    prefill_urls: list[str] = Field(default_factory=list)
    decode_urls: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    request_timeout_s: float = Field(default=600.0, gt=0)


class SimConfig(_Strict):
    """``llmkit sim``: replay a ``bench`` workload on modelled hardware (``hardware=NAME``)."""

    # The model to simulate: a named shape (llmkit/cost_model/shapes/NAME.json, e.g. llama-2-7b), a
    # config.json, an HF folder or a .gguf (no weights are read). null = MODEL / model.path.
    model: str | None = None
    # With sim.model: the context limit (null = the shape's max_position_embeddings). Without
    # it, model.max_model_len applies as for a real engine.
    max_model_len: int | None = Field(default=None, ge=1)
    # auto = model.dtype if set, else the checkpoint's torch_dtype, else hardware.default_dtype
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    # vLLM's name: the fraction of device memory the engine may use (weights + activations +
    # KV pool); the KV pool gets what is left after the weights and activations.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # Stop after this many engine steps (a guard; null = run the workload to the end).
    max_steps: int | None = Field(default=None, ge=1)
    # `llmkit sim calibrate` writes the cpu-local profile here, and `hardware=cpu-local` reads
    # it from here when it exists. null = <llmkit cache>/hardware/cpu-local.yaml
    calibrate_output: str | None = None
    # calibrate: the square GEMM size and the buffer (MiB) of the bandwidth test
    calibrate_gemm_size: int = Field(default=1024, ge=64)
    calibrate_buffer_mib: int = Field(default=256, ge=8)
    # calibrate engine: a step trace (observability.trace_file) of `llmkit serve` running the
    # same model under load; its steps, priced by the fitted profile, give frontend_token_us.
    calibrate_trace: str | None = None


class EvalConfig(_Strict):
    """``llmkit eval ppl`` (``llmkit/tools/eval/perplexity.py``)."""

    # null = the public-domain text shipped in llmkit/tools/eval/texts/
    text_file: str | None = None
    # tokens per window (request)
    window: int = Field(default=512, ge=2)
    # sliding: a window starts every `stride` tokens (null = window / 2); llamacpp: must be null
    stride: int | None = Field(default=None, ge=1)
    # sliding: Hugging Face's strided perplexity; llamacpp: what llama-perplexity computes
    # (non-overlapping windows, the second half of each scored)
    mode: Literal["sliding", "llamacpp"] = "sliding"


class PlanConfig(_Strict):
    """``llmkit plan`` (``llmkit/tools/plan/``): the search space (one list of values per
    knob; the plan simulates every combination the cores allow), what it verifies and where
    it writes. The workload is ``bench.*`` (or ``plan.trace``, then ``plan.rate`` /
    ``num_requests`` / ``input_len`` / ``output_len``), the objective ``slo.*``."""

    # -- the search space ------------------------------------------------------------------
    max_num_seqs: list[int] = Field(default_factory=lambda: [4, 8, 16, 32], min_length=1)
    # the token budget of a step, which is also the prefill chunk size
    max_num_batched_tokens: list[int] = Field(default_factory=lambda: [256, 512, 2048],
                                              min_length=1)
    # scheduler implementations (the group `scheduler`: conf/scheduler/) and their queue
    # policies (scheduler.policy); slo serves to slo.* (left out when no slo.ttft_ms /
    # slo.tpot_ms is set)
    scheduler: list[str] = Field(default_factory=lambda: ["token_budget", "slo"], min_length=1)
    policy: list[Literal["fcfs", "priority"]] = Field(default_factory=lambda: ["fcfs"],
                                                      min_length=1)
    # scheduler=slo's keys (scheduler.slo_admission, scheduler.slo_tpot: docs/slo.md); the
    # token-budget scheduler takes their defaults only
    slo_admission: list[Literal["off", "defer", "reject"]] = Field(
        default_factory=lambda: ["off"], min_length=1)
    slo_tpot: list[Literal["step", "mean"]] = Field(default_factory=lambda: ["step"],
                                                    min_length=1)
    # speculative decoding (the group `speculative`; none = off) and its K for each method
    speculative: list[str] = Field(default_factory=lambda: ["none", "ngram"], min_length=1)
    num_speculative_tokens: list[int] = Field(default_factory=lambda: [2, 4], min_length=1)
    kv_cache_dtype: list[Literal["auto", "bfloat16", "float16", "fp8_e4m3", "fp8", "int8"]] = \
        Field(default_factory=lambda: ["auto"], min_length=1)
    quantization: list[Literal["auto", "none", "int8", "fp8", "gguf"]] = Field(
        default_factory=lambda: ["auto"], min_length=1)
    # parallel sizes: a combination is searched only when TP x PP x DP <= plan.cores
    tensor_parallel_size: list[int] = Field(default_factory=lambda: [1], min_length=1)
    pipeline_parallel_size: list[int] = Field(default_factory=lambda: [1], min_length=1)
    data_parallel_size: list[int] = Field(default_factory=lambda: [1], min_length=1)
    # the devices the parallel sizes may use; null = this process's usable CPU cores
    cores: int | None = Field(default=None, ge=1)
    # -- the workload ----------------------------------------------------------------------
    # a `bench serve` / `llmkit sim` result JSON (the trace of a run): its bench.* workload
    # (and slo.*, where the command line sets none) replace the configured ones
    trace: str | None = None
    # the workload in short (each, when set, replaces its bench.* key: bench.rate,
    # bench.num_requests, bench.input_len, bench.output_len), applied after plan.trace
    rate: float | None = Field(default=None, gt=0)
    num_requests: int | None = Field(default=None, ge=1)
    input_len: int | None = Field(default=None, ge=1)
    output_len: int | None = Field(default=None, ge=1)
    # -- verification and output -----------------------------------------------------------
    # the best N candidates are served (`llmkit serve`) and measured with `bench serve` on the
    # same workload; 0 = predict only
    verify_top: int = Field(default=1, ge=0)
    # seconds to wait for a verification server to answer /health
    server_timeout_s: float = Field(default=600.0, gt=0)
    # hardware=cpu-local with no calibrated profile: run `llmkit sim calibrate engine` first
    # (cached) instead of simulating the shipped placeholder
    calibrate: bool = True
    # before the search, a short check times a few steps of the real engine (seconds) against
    # the cached profile's prediction (hardware=cpu-local): off by more than this fraction
    # (expected / measured - 1 of the median step shape), the profile is stale
    # (calibrated on a machine or build that ran differently); null = no check
    max_profile_error: float | None = Field(default=0.2, gt=0)
    # a stale profile: recalibrate (`llmkit sim calibrate engine`, unless plan.calibrate=false),
    # refuse (stop, naming the command), or warn (plan on it, saying so)
    stale_profile: Literal["recalibrate", "refuse", "warn"] = "recalibrate"
    # a verified candidate off its prediction by more than this (|predicted / measured - 1|):
    # fit the profile's front-end term to that server's step trace and predict the verified
    # ones again with it (llmkit.tools.plan.recalibrate); null = never
    recalibrate_error: float | None = Field(default=0.2, gt=0)
    # recipe.yaml, table.txt, plan.png, plan.json (and verify/ with bench serve's results)
    output_dir: str = "plan_results"
    # where the chosen recipe goes (null: <output_dir>/recipe.yaml)
    output: str | None = None

    @field_validator("max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens",
                     "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError(f"every value must be >= 1, got {v}")
        return v


class ToolConfig(_Strict):
    """A tool's config: the engine's inside, the tool's own sections beside it."""

    engine: EngineConfig

    def flat_dump(self, **kwargs) -> dict:
        """The config as ``llmkit config`` and result files show it: the engine's sections
        and the tool's side by side, keyed as on the command line (``model_dump`` kwargs)."""
        data = self.engine.model_dump(**kwargs)
        for name in type(self).model_fields:
            if name != "engine":
                value = getattr(self, name)
                data[name] = value.model_dump(**kwargs) if value is not None else None
        return data


T = TypeVar("T", bound=ToolConfig)


class BenchToolConfig(ToolConfig):
    """``llmkit bench ...``: the engine (``bench throughput|latency`` build it; ``bench serve``
    takes its tokenizer and ``server.host|port``) and the benchmark's own sections."""

    bench: BenchConfig = Field(default_factory=BenchConfig)
    slo: SloConfig = Field(default_factory=SloConfig)


class ProxyToolConfig(ToolConfig):
    """``llmkit proxy``: the proxy's section (the engine's is composed but unused)."""

    proxy: ProxyConfig = Field(default_factory=ProxyConfig)


class EvalToolConfig(ToolConfig):
    """``llmkit eval ppl``: the engine that scores the text and the evaluation's settings."""

    eval: EvalConfig = Field(default_factory=EvalConfig)


class SimToolConfig(BenchToolConfig):
    """``llmkit sim``: a ``bench serve`` workload (``bench``, ``slo``) replayed through the
    engine's scheduler and KV cache on a modelled accelerator (group ``hardware``)."""

    hardware: HardwareConfig | None = None
    sim: SimConfig = Field(default_factory=SimConfig)


class PlanToolConfig(SimToolConfig):
    """``llmkit plan``: the simulator's config (the workload, the SLO, the hardware) and the
    search's (``plan``)."""

    plan: PlanConfig = Field(default_factory=PlanConfig)


class AllToolsConfig(SimToolConfig):
    """``llmkit config``: every tool's sections beside the engine's (it shows those that the
    command line sets)."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)


class ToolsConfig(EngineConfig):
    """What the tools' root (``conf/tools/tools.yaml``) composes to: the engine's sections and
    every tool's. Used to validate a composition (every key of every tool, whichever tool runs)
    and to name keys in errors; nothing past the composer receives it."""

    bench: BenchConfig = Field(default_factory=BenchConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    # `llmkit sim`: the modelled accelerator (group `hardware`) and the simulation's settings
    hardware: HardwareConfig | None = None
    sim: SimConfig = Field(default_factory=SimConfig)
    # `llmkit eval ppl`
    eval: EvalConfig = Field(default_factory=EvalConfig)
    # `llmkit proxy`
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    # `llmkit plan`
    plan: PlanConfig = Field(default_factory=PlanConfig)

    def engine_config(self) -> EngineConfig:
        """The engine's part (already validated: no second validation)."""
        fields = {name: getattr(self, name) for name in EngineConfig.model_fields}
        return EngineConfig.model_construct(
            _fields_set=self.model_fields_set & set(fields), **fields)

    def tool_config(self, tool: type[T]) -> T:
        """``tool``'s config: the engine's part and the sections ``tool`` declares."""
        sections = {name: getattr(self, name) for name in tool.model_fields if name != "engine"}
        return tool(engine=self.engine_config(), **sections)


#: The top-level sections of the composed document that belong to tools, not to the engine.
TOOL_SECTIONS = tuple(n for n in ToolsConfig.model_fields if n not in EngineConfig.model_fields)
