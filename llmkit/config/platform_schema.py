"""The ``platform`` group's config: where and how the engine computes (device, threads, the CPU
kernels, their instruction-set tier and dispatch table)."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from llmkit.config.sections.strict import _Component, _Strict

__all__ = ["CpuDispatchConfig", "PlatformConfig"]


class CpuDispatchConfig(_Strict):
    """Overrides of the CPU dispatch table (``llmkit.config.cpu_dispatch.CpuDispatch``, which
    documents each choice): the row counts at which the CPU components switch kernels. null =
    the table's value for the instruction-set tier (``platform.isa``); ``llmkit config`` shows
    the resolved table. Each path of the row counts computes its own bits, so a change there can
change outputs; ``linear_prefetch_bytes`` and ``linear_thread_min_bytes`` change speed only
(``platform.calibrate`` times them)."""

    linear_small_batch_max_rows: int | None = Field(default=None, ge=0)
    linear_packed_max_rows: int | None = Field(default=None, ge=0)
    lora_small_batch_max_rows: int | None = Field(default=None, ge=0)
    attention_min_compiled_decode_rows: int | None = Field(default=None, ge=1)
    attention_max_expanded_query_len: int | None = Field(default=None, ge=1)
    # a ceiling: the platform lowers it to the rows the model's linear layers keep one kernel
    step_graph_max_rows: int | None = Field(default=None, ge=1)
    top_p_candidates: int | None = Field(default=None, ge=1)
    ranks_per_core: int | None = Field(default=None, ge=1)
    # speed only (each value computes the same bits): timed at first start unless given
    linear_prefetch_bytes: int | None = Field(default=None, ge=0)
    linear_thread_min_bytes: int | None = Field(default=None, ge=0)
    # speed only, not timed: how long the kernels' idle threads spin (0: torch's threads)
    thread_pool_spin_us: int | None = Field(default=None, ge=0)


class PlatformConfig(_Component):
    name: str = "auto"
    # CPU threads for torch; 0 = all cores the process may use.
    num_threads: int = Field(default=0, ge=0)
    # CPU: add a copy of each linear weight in oneDNN's blocked layout after loading (faster
    # GEMMs at decode batch sizes; a second copy of the weights in memory). bf16 models on CPUs
    # without native bf16 also compute their linears in float32 (bf16 GEMMs are emulated there).
    # In the amx tier bf16 weights get a copy in AMX tile order instead (llmkit's tile linear).
    packed_linear: bool = True
    # CPU: llmkit's C++ kernels (fused norms, SiLU, rotary, KV writes, paged decode attention),
    # built on first use and cached. auto: use them if they build here (warn and use torch ops
    # if not); on: fail at start-up if they cannot be built; off: torch ops only.
    native_kernels: Literal["auto", "on", "off"] = "auto"
    # CPU: the instruction-set tier of llmkit's C++ kernels and of the choices llmkit makes from
    # the CPU's flags (model.dtype=auto, the bf16 linear path). auto: the best this CPU
    # supports; a named tier forces it (one the CPU lacks is refused at start-up). Lowest first:
    # avx2 < avx2_vnni < avx512 < avx512_vnni < avx512_bf16 (llmkit.config.cpu_isa).
    isa: Literal["auto", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "avx512_bf16",
                 "amx"] = "auto"
    # CPU: the dispatch table's overrides (which kernel runs at which row count); null = the
    # tier's defaults.
    dispatch: CpuDispatchConfig = Field(default_factory=CpuDispatchConfig)
    # CPU: time the dispatch table's speed-only fields (llmkit.config.cpu_dispatch.CALIBRATED)
    # on the kernels at first start (a few seconds) and cache the fastest with the kernel
    # build, keyed by the CPU's model, flags and threads. auto: time once, then read the
    # cache; force: time again; off: the tier's defaults. Fields given in dispatch are never
    # timed. Default: $LLMKIT_CALIBRATE, else auto (the test suite sets off).
    calibrate: Literal["auto", "off", "force"] = Field(
        default_factory=lambda: os.environ.get("LLMKIT_CALIBRATE", "auto"),
        validate_default=True)

    @field_validator("isa")
    @classmethod
    def _isa_on_this_cpu(cls, value: str) -> str:
        from llmkit.config.cpu_isa import why_unsupported

        problem = None if value == "auto" else why_unsupported(value)
        if problem is not None:
            raise ValueError(problem)  # e.g. a tier this CPU lacks
        return value
