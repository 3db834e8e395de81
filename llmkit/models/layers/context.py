"""What a model and every layer in it are built with (``ModelContext``). It sits with the layers,
below the model interface (``llmkit.models.base``, which re-exports it), because layers that
build their own attention or recurrent state (``mla``, ``mamba2``) take it too: the layers
never import the models package above them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.attention.base import AttentionBackend
from llmkit.distributed.group import TensorParallelGroup
from llmkit.distributed.pipeline import PipelineParallelGroup
from llmkit.linear.base import LinearMethodFactory
from llmkit.linear.torch_linear import TorchLinearMethod
from llmkit.ops.base import ModelOps


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a model is built with: its dtype, the attention backend, the platform's ops, the
    factory of linear methods (one per linear layer it declares) and its tensor-parallel group
    (the model builds its rank's heads; ``linear_method`` already splits the layers) and
    pipeline stage."""

    attn_backend: AttentionBackend
    dtype: torch.dtype = torch.float32
    ops: ModelOps = ModelOps()
    linear_method: LinearMethodFactory = lambda spec: TorchLinearMethod()
    tp: TensorParallelGroup = TensorParallelGroup()
    # parallel.enable_expert_parallel: a MoE model splits its experts over the tp ranks
    # (whole experts per rank) instead of every expert's intermediate dimension
    enable_expert_parallel: bool = False
    # its pipeline stage: a model that declares ``supports_pp = True`` builds only that
    # stage's layers (the others absent: PPMissingLayer)
    pp: PipelineParallelGroup = PipelineParallelGroup()
    # model.quantization as resolved (none, gguf, int8, fp8): with gguf the loader hands a
    # GGUF's kept blocks to the linear methods, which must be quantized ones
    quantization: str = "none"
    # model.mla: how multi-head latent attention models (DeepSeek) keep and read their KV:
    # absorbed = one latent row per token, expanded = K and V per head (a comparison point)
    mla: str = "absorbed"
