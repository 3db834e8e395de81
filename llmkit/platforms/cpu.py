from __future__ import annotations

import functools
import logging
import os

import torch

from llmkit.platforms.base import Platform

logger = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """AMX or AVX-512-BF16: bf16 matmuls run at least as fast as float32."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    default_attention = "cpu"
    dist_backend = "gloo"

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]
        # bf16 halves the bytes a decode step reads, and AMX / AVX-512-BF16 CPUs compute it
        # natively. Elsewhere (AVX2 only) torch emulates bf16 matmuls 2-5x slower than float32,
        # so `model.dtype: auto` picks float32 there.
        if has_native_bf16():
            return torch.bfloat16
        logger.info("this CPU has no native bf16 (AMX/AVX-512-BF16): model.dtype=auto uses "
                    "float32; set model.dtype=bfloat16 to force bf16")
        return torch.float32

    @classmethod
    def is_available(cls) -> bool:
        return True

    def packs_linear_weights(self, dtype: torch.dtype) -> bool:
        # oneDNN packs float32 on any x86 CPU; its bf16 packing needs AVX-512 or AVX-NE-CONVERT.
        return (self.config.packed_linear and dtype == torch.float32
                and torch.backends.mkldnn.is_available())

    def apply_runtime_settings(self) -> None:
        threads = self.config.num_threads or len(os.sched_getaffinity(0))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
