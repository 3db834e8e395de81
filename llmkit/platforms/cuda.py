from __future__ import annotations

import torch

from llmkit.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    default_dtype = torch.bfloat16
    default_attention = "torch"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()
