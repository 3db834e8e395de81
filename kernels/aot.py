"""Ahead-of-time compilation of llmkit's kernels for a CUDA target, on any machine.

Triton's interpreter (the CPU tests) runs a kernel's Python semantics but not Triton's compiler:
type rules, ``tl.dot`` shape limits or register/shared-memory budgets show up only when the
kernel is compiled. ``compile_launch`` compiles one recorded launch (see
``llmkit.kernels._jit.record_launches``) for e.g. ``sm_90`` down to a cubin with the ``ptxas``
that ships with Triton -- no GPU needed -- so the launch configurations the launchers really
produce are checked where no GPU exists.
"""
from __future__ import annotations

import inspect

import torch

from llmkit.kernels._jit import Launch

_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                  torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
                  torch.bool: "i1"}


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def signature(launch: Launch) -> tuple[dict[str, str], dict[str, object]]:
    """Triton's ``(signature, constexprs)`` for a recorded launch (no value specialisation)."""
    fn = launch.kernel.fn
    kwargs = {k: v for k, v in launch.kwargs.items() if k not in _LAUNCH_OPTIONS}
    bound = inspect.signature(fn).bind(*launch.args, **kwargs)
    annotations = inspect.get_annotations(fn)
    sig: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    for name, value in bound.arguments.items():
        ann = annotations.get(name)
        if ann is not None and "constexpr" in str(ann):
            sig[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TRITON_DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel.name}: cannot type argument {name}={value!r}")
    return sig, constexprs


def compile_launch(launch: Launch, arch: int = 90, num_warps: int = 4):
    """Compile a recorded launch for ``sm_<arch>``; returns Triton's ``CompiledKernel`` (its
    ``metadata.shared`` is the shared memory it needs). Raises on any compile error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    sig, constexprs = signature(launch)
    src = ASTSource(JITFunction(launch.kernel.fn), sig, constexprs=constexprs)
    options = {"num_warps": launch.kwargs.get("num_warps", num_warps)}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
