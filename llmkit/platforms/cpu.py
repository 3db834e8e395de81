from __future__ import annotations

import os

import torch

from llmkit.platforms.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    # bf16 halves the bytes a decode step reads, and AMX/AVX-512-bf16 CPUs compute it natively.
    default_dtype = torch.bfloat16
    default_attention = "torch"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def apply_runtime_settings(self) -> None:
        threads = self.config.num_threads or len(os.sched_getaffinity(0))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
