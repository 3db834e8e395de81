from __future__ import annotations

import torch

from llmkit.ops.base import ModelOps
from llmkit.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    default_dtype = torch.bfloat16
    # Fused Triton kernels that read the paged KV cache in place (llmkit.kernels).
    default_attention = "triton"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def ops(self, dtype: torch.dtype) -> ModelOps:
        from llmkit.ops.triton_ops import TritonOps
        return TritonOps()
