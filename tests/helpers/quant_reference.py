"""Reference linear methods for the quantized engine tests: dense float64 products with the
weights and activations each quantized kernel computes with, on the float loading path
(``model.quantization=none``, forced as ``model.linear_method=helpers.quant_reference.<Class>``).

The integer kernels (GGUF formats, int8) compute ``x_hat @ W.T`` with ``x_hat`` the activations
quantized to 8 bits per 32-input block (``quantize_activations_ref``, the kernel's bits) and W
the GGUF-dequantized weights (``kernels/quant/reference.py``); fp8 multiplies float
activations. The LM head stays float under int8 / fp8, as in ``QuantizedLinearMethod``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.kernels.quant.reference import BLOCK, padded, quantize_activations_ref
from llmkit.kernels.quant.weights import fp8_codes, int8_codes
from llmkit.linear.base import LinearMethod


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x_hat`` [rows, k] (the kernel's 8-bit-per-block activations)."""
    rows, k = x.shape
    q, d, _ = quantize_activations_ref(x)
    xq = q.to(torch.float64).reshape(rows, -1, BLOCK) * d.to(torch.float64).unsqueeze(-1)
    return xq.reshape(rows, padded(k))[:, :k]


class _Reference(LinearMethod):
    quantize_acts = True
    weight_mode: str | None = None  # None (GGUF: weights as dequantized), int8, fp8

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.plain = self.weight_mode is not None and layer.spec.prefix == "lm_head"
        w = layer.weight.detach().float()
        if self.weight_mode == "int8" and not self.plain:
            codes, scales = int8_codes(w)
            w = codes.double() * scales.double().unsqueeze(1)
        elif self.weight_mode == "fp8" and not self.plain:
            codes, scales = fp8_codes(w)
            w = codes.double() * scales.double().unsqueeze(1)
        self.w64 = w.double()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return F.linear(x, layer.weight, layer.bias)
        x64 = quantized_activations(x) if self.quantize_acts else x.double()
        y = x64 @ self.w64.T
        if layer.bias is not None:
            y = y + layer.bias.double()
        return y.to(x.dtype)


class GGUFReference(_Reference):
    name = "gguf-reference"


class Int8Reference(_Reference):
    name = "int8-reference"
    weight_mode = "int8"


class Fp8Reference(_Reference):
    name = "fp8-reference"
    weight_mode = "fp8"
    quantize_acts = False


class GGUFReference32(GGUFReference):
    """The same products summed in float32 (another order): how far rounding alone moves a
    deep model whose activations are re-quantized at every layer."""

    name = "gguf-reference-float32"

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = quantized_activations(x).float() @ self.w64.float().T
        return y if layer.bias is None else y + layer.bias
