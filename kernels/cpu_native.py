"""llmkit's C++ kernels for CPUs (sources in ``cpu/``), registered as ``torch.ops.llmkit_cpu``.

Eager torch spends most of a small model's decode step outside its matmuls: a Llama layer is
~50 small ops (RMSNorm alone is eight), each paying Python and dispatcher overhead, and small
decode batches' attention gathers the context into a padded copy first. These kernels fuse each
of those pieces into one call: ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``,
``rotary_embedding_`` (in place), ``reshape_and_cache``, ``paged_decode_attention`` (reads
K/V through the block table in place), a small-batch ``linear`` (up to a few rows: decoding's
GEMVs) and ``llama_decode_layer`` (a whole Llama-family layer for a decode step, as one call).
The quantized-weight ops (``quant_repack``, ``quant_linear``, ``quant_dequantize``,
``quantize_activations_q8``: GGUF blocks, int8 and fp8 kept packed) are wrapped by
``llmkit.kernels.quant``.
Each rounds to the model's dtype exactly where the torch ops of Hugging Face's model round, and
where it can, adds in their order too: RMSNorm, SiLU-and-mul, rotary and the bf16 linear (each
row in torch's one-row GEMV order) give their bits; bf16 decode attention follows SDPA's flash
kernel (most outputs bit-equal, the rest a bf16 step away); float32 attention and linears
reorder sums only.

They are built on first use with torch's C++ extension builder (a C++ compiler and ninja;
~20 s on 2 cores) into ``~/.cache/llmkit/cpu_kernels/<key>`` (``LLMKIT_CACHE_DIR``
moves it), keyed by the sources, torch's version and the compile flags; later processes load
the built library in milliseconds. The platform decides whether they are used
(``platform.native_kernels``).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu")
LIBRARY = "llmkit_cpu"


class CpuKernelBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded here (the message says why)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (``/proc/cpuinfo``; empty elsewhere).
    The kernels are compiled for them, and the ``cpu`` platform reads them too."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return frozenset()
    return frozenset()


def compile_flags() -> list[str]:
    """``-ffp-contract=off``: no fused multiply-adds where torch's element-wise ops round the
    product first (the kernels must round where the op sequence they replace rounds). AVX2
    vectors where the CPU has them (ATen's ``Vectorized`` otherwise falls back to plain loops)."""
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]
    if {"avx2", "fma"} <= cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def _build_key(flags: list[str]) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()[:16]


def build_directory(key: str) -> Path:
    root = os.environ.get("LLMKIT_CACHE_DIR") or os.path.join(Path.home(), ".cache", "llmkit")
    return Path(root) / "cpu_kernels" / key


def _first_error(exc: BaseException) -> str:
    """The compiler's first error line, else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [repr(exc)])[0 if errors else -1]


@functools.cache
def load_cpu_kernels():
    """``torch.ops.llmkit_cpu`` once the library is built (or found in the cache) and loaded.

    Raises ``CpuKernelBuildError`` with the reason when it cannot be built here.
    """
    from torch.utils import cpp_extension

    flags = compile_flags()
    key = _build_key(flags)
    directory = build_directory(key)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        cpp_extension.load(
            name=f"{LIBRARY}_{key}", sources=[str(SOURCE_DIR / "ops.cpp")],
            extra_cflags=flags, extra_ldflags=["-fopenmp"], extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(directory), is_python_module=False, with_cuda=False,
            verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # compiler or ninja missing, or a build error
        raise CpuKernelBuildError(f"building llmkit's CPU kernels in {directory} failed: "
                                  f"{_first_error(exc)}") from exc
    logger.info("llmkit CPU kernels ready in %.1f s (%s)", time.perf_counter() - t0, directory)
    return getattr(torch.ops, LIBRARY)
