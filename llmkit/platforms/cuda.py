from __future__ import annotations

import torch

from llmkit.compilation.base import StepGraphs
from llmkit.config.schema import CompilationConfig
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

    def step_graphs(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                    config: CompilationConfig, max_num_seqs: int) -> StepGraphs | None:
        if config.mode != "graphs" or not model.attn_backend.supports_step_graphs:
            return None
        from llmkit.compilation.cuda_graphs import CudaStepGraphs
        return CudaStepGraphs(model, kv_caches, max_num_seqs, config.cudagraph_capture_sizes)
