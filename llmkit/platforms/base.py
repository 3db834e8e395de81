"""Platforms: what the serving core needs to know about a device, and nothing more.

A platform answers capability questions (device, default dtype, default attention backend,
distributed backend) and applies process-wide runtime settings; it is not a base class of the
components that run on it. Out-of-tree platforms register through the
``llmkit.platform_plugins`` entry point group.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import logging

import torch

from llmkit.compilation.base import StepGraphs
from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.config.schema import CompilationConfig, PlatformConfig
from llmkit.linear.base import LinearMethodFactory
from llmkit.linear.torch_linear import TorchLinearMethod
from llmkit.ops.base import ModelOps

logger = logging.getLogger(__name__)


class Platform(ABC):
    name: str = "base"
    device_type: str = "cpu"
    default_dtype: torch.dtype = torch.float32
    default_attention: str = "torch"
    dist_backend: str = "gloo"
    #: The per-step fast-path choices handed to the components this platform's models are
    #: built from (``llmkit.config.cpu_dispatch.CpuDispatch`` on the CPU); None: the
    #: components' own defaults.
    dispatch: CpuDispatch | None = None
    #: The instruction-set tier the kernels were built for (``platform.isa``, CPU only);
    #: None: no native kernels' tier.
    isa: str | None = None

    def __init__(self, config: PlatformConfig) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def preferred_dtype(self) -> torch.dtype:
        """What ``model.dtype=auto`` means on this platform: its faster dtype for the job.
        The one place that choice is made."""
        return self.default_dtype

    def apply_runtime_settings(self) -> None:
        """Process-wide settings (threads, allocator) made once at engine start."""

    def ops(self, dtype: torch.dtype) -> ModelOps:
        """The ops a model of ``dtype`` is built over (norms, rotary, activation, KV write,
        paged decode attention): the torch reference unless the platform has faster ones."""
        return ModelOps()

    def linear_method_factory(self, dtype: torch.dtype) -> LinearMethodFactory:
        """The linear method for each linear layer of a model of ``dtype`` (the platform's
        choice from the layer's spec; a method may dispatch by row count inside itself)."""
        return lambda spec: TorchLinearMethod()

    def quantized_linear_method_factory(self, dtype: torch.dtype, mode: str
                                        ) -> LinearMethodFactory | str:
        """The linear methods of a model whose weights stay quantized (``model.quantization``
        resolved: gguf, int8, fp8), or why this platform cannot run them (a sentence)."""
        return f"platform {self.name!r} has no quantized-weight kernels"

    def step_graphs(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                    config: CompilationConfig, max_num_seqs: int) -> StepGraphs | None:
        """The step graphs for ``model`` (``compilation.mode=graphs``), or None: decode
        steps then run eagerly (this platform has none)."""
        if config.mode == "graphs":
            logger.info("compilation.mode=graphs: platform %r has no step graphs; decode steps "
                        "run eagerly", self.name)
        return None

    def native_kernels(self, dtype: torch.dtype):
        """llmkit's C++ kernels for this device and ``dtype`` (``torch.ops.llmkit_cpu``), or
        ``None`` to compute with torch ops. Only the CPU platform has them."""
        if self.config.native_kernels == "on":
            raise ValueError(f"platform.native_kernels=on: llmkit's native kernels are CPU "
                             f"kernels; platform {self.name!r} has none (allowed here: auto, off)")
        return None

    def kv_cache_budget_bytes(self, memory_gib: float) -> int:
        return int(memory_gib * (1 << 30))

    def measure_step_costs(self, time_step: Callable[[int], float], fine_upto: int,
                           max_rows: int) -> dict[int, float]:
        """Seconds of a decode step by its rows (adaptive speculative decoding weighs a step
        of ``rows x (1 + k)`` tokens against the tokens it is expected to yield).
        ``time_step(n)`` runs one step of ``n`` rows and returns its seconds. Every count up
        to ``fine_upto`` (1 + K: a verify step at batch 1, where a kernel's row tiles make the
        cost per row uneven), then doubling until the step costs 4x a one-row step or
        ``max_rows``; the least of five each (other work on the machine only ever adds time).
        A platform with a calibrated profile may return figures instead."""
        time_step(1)  # warm-up: first-call costs are no part of the curve
        timings: dict[int, float] = {}
        counts = list(range(1, max(1, min(fine_upto, max_rows)) + 1))
        n = counts[-1] * 2
        while n <= max_rows:
            counts.append(n)
            n *= 2
        for n in counts:
            timings[n] = min(time_step(n) for _ in range(5))
            if n > fine_upto and timings[n] > 4.0 * timings[1]:
                break
        return timings


def ridge_from_timings(timings: dict[int, float]) -> int:
    """The knee of a roofline ``t(n) = max(t0, c n)`` through measured forward times: ``t0`` is
    the one-token time, ``c`` the slope between the two largest token counts; the ridge is
    ``t0 / c`` (where compute time reaches the fixed, memory-bound time), clamped to the
    measured range. A curve that never rises gives the largest count measured."""
    ns = sorted(timings)
    if not ns:
        raise ValueError("no timings")
    t0 = timings[ns[0]]
    if len(ns) < 2:
        return ns[0]
    a, b = ns[-2], ns[-1]
    slope = (timings[b] - timings[a]) / (b - a)
    if slope <= 0:
        return ns[-1]
    return int(max(1, min(ns[-1], round(t0 / slope))))
