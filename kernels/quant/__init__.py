"""Quantized weights for the CPU kernels: formats, packing, the linear, and torch references.

=================  ==========================================================================
module             what
=================  ==========================================================================
formats            the kept formats (GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; int8; fp8) and the
                   torch dequantize of GGUF blocks (gguf-py's values, bit for bit)
weights            ``PackedWeight``; ``pack_gguf``, ``quantize_int8``, ``quantize_fp8``;
                   ``quant_linear`` (any number of rows) and ``dequantize`` (row lookup)
reference          the exact integer-form references the kernels are tested against
=================  ==========================================================================

The C++ kernels are in ``kernels/cpu/quant_*.h`` (``torch.ops.llmkit_cpu.quant_*``).
"""
