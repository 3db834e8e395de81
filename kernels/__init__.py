"""Triton kernels and their torch references, installed as ``llmkit.kernels``.

llmkit's GPU data plane: fused kernels that read the paged KV cache in place. Each kernel has a
torch reference next to it (``<name>_ref``) with the same signature, used by the tests (under
``TRITON_INTERPRET=1`` on a CPU) and by ``benchmarks/gpu/check_kernels.py`` on a GPU.

===========================  ======================  ================================
kernel                       module                  reference
===========================  ======================  ================================
reshape_and_cache            cache                   reshape_and_cache_ref
paged_decode_attention       decode_attention        paged_decode_attention_ref
  (+ split-KV reduce)        split_kv
unified_attention            unified                 unified_attention_ref
rms_norm                     norm                    rms_norm_ref
fused_add_rms_norm           norm                    fused_add_rms_norm_ref
rotary_embedding             rotary                  rotary_embedding_ref
silu_and_mul                 activation              silu_and_mul_ref
fused_moe                    moe                     llmkit.ops.moe.fused_moe_reference
write_latent_cache           mla_attention           write_latent_cache_ref
mla_decode_attention         mla_attention           mla_decode_attention_ref
  (+ split-KV reduce)        split_kv
===========================  ======================  ================================

A quantized KV cache (``kv_quant``: int8 / e4m3 rows with their float32 scale) is written by
``_reshape_and_cache_quant_kernel`` and read by the attention kernels, which dequantize.

Whether a launch compiles for the GPU or runs in Triton's interpreter is decided at launch time
from ``TRITON_INTERPRET`` (see ``_jit``), so import order never matters. Importing this package
does not import Triton; the kernel modules do, on first use. (No module is named like the
function it exports, so a submodule import never shadows a lazily exported function.)
"""
from __future__ import annotations

import importlib

if __name__ == "kernels":
    # This folder is llmkit.kernels. Python finds it under the top-level name ``kernels`` only
    # when a clone's root is on sys.path (``python -m ...`` started there), and that name belongs
    # to the hub's ``kernels`` package, which transformers >= 5.25 imports: hand the import over
    # to it (or fail as if this folder were not there).
    import os
    import sys
    import importlib.util
    from importlib.machinery import PathFinder

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = PathFinder.find_spec("kernels", [p for p in sys.path
                                             if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (this folder is llmkit.kernels)",
                                  name="kernels")
    sys.modules["kernels"] = _hub = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_hub)

from llmkit.kernels._jit import (KernelLaunchError, count_launches, interpreter_enabled,
                                 launch_counts, unavailable_reason)

_EXPORTS = {
    "reshape_and_cache": "cache", "reshape_and_cache_ref": "cache",
    "paged_decode_attention": "decode_attention",
    "paged_decode_attention_ref": "decode_attention",
    "default_num_splits": "split_kv", "device_num_splits": "split_kv",
    "unified_attention": "unified", "unified_attention_ref": "unified",
    "unified_attention_tiles": "unified", "choose_block_q": "unified",
    "rms_norm": "norm", "rms_norm_ref": "norm",
    "fused_add_rms_norm": "norm", "fused_add_rms_norm_ref": "norm",
    "rotary_embedding": "rotary", "rotary_embedding_ref": "rotary",
    "silu_and_mul": "activation", "silu_and_mul_ref": "activation",
    "fused_moe": "moe", "moe_align_block_size": "moe",
    "write_latent_cache": "mla_attention", "write_latent_cache_ref": "mla_attention",
    "mla_decode_attention": "mla_attention", "mla_decode_attention_ref": "mla_attention",
}

#: Kernel names (as counted by ``launch_counts``) by the public function that launches them.
KERNELS = {
    "reshape_and_cache": ("_reshape_and_cache_kernel", "_reshape_and_cache_quant_kernel"),
    "paged_decode_attention": ("_paged_decode_kernel", "_decode_reduce_kernel"),
    "unified_attention": ("_unified_attention_kernel",),
    "rms_norm": ("_rms_norm_kernel",),
    "fused_add_rms_norm": ("_rms_norm_kernel",),
    "rotary_embedding": ("_rotary_kernel",),
    "silu_and_mul": ("_silu_and_mul_kernel",),
    "fused_moe": ("_fused_moe_kernel", "_silu_and_mul_kernel"),
    "write_latent_cache": ("_write_latent_kernel",),
    "mla_decode_attention": ("_mla_decode_kernel", "_decode_reduce_kernel"),
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmkit.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"llmkit.kernels.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["KERNELS", "KernelLaunchError", "count_launches", "interpreter_enabled",
           "launch_counts", "unavailable_reason", *_EXPORTS]
