"""llmkit's C++ kernels for CPUs (sources in ``cpu/``), registered as ``torch.ops.llmkit_cpu_<tier>``.

Eager torch spends most of a small model's decode step outside its matmuls: a Llama layer is
~50 small ops (RMSNorm alone is eight), each paying Python and dispatcher overhead, and small
decode batches' attention gathers the context into a padded copy first. These kernels fuse each
of those pieces into one call: ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``,
``rotary_embedding_`` (in place), ``reshape_and_cache``, ``paged_decode_attention`` (reads
K/V through the block table in place), ``write_latent_cache`` and ``mla_decode_attention``
(multi-head latent attention's decode rows: one latent row read serves every head), a small-batch ``linear`` (up to a few rows:
decoding's GEMVs) and ``lora_add_`` (each row's own LoRA adapter delta, every row and shard of a
layer in one call: multi-LoRA decoding). Each op also has a fake (meta) implementation, so that step graphs
(``torch.compile``) trace through them as opaque calls.
The quantized-weight ops (``quant_repack``, ``quant_linear``, ``quant_dequantize``,
``quantize_activations_q8``: GGUF blocks, int8 and fp8 kept packed) are wrapped by
``llmkit.kernels.quant``.
Each rounds to the model's dtype exactly where the torch ops of Hugging Face's model round, and
where it can, adds in their order too: RMSNorm, SiLU-and-mul, rotary and the bf16 linear (each
row in torch's one-row GEMV order) give their bits; bf16 decode attention follows SDPA's flash
kernel (most outputs bit-equal, the rest a bf16 step away); float32 attention and linears
reorder sums only.

They are built on first use with torch's C++ extension builder (a C++ compiler and ninja;
~20 s on 2 cores) into ``<llmkit cache>/cpu_kernels/<key>`` (``$LLMKIT_CACHE``, default
``~/.cache/llmkit``), keyed by everything the build depends on (``build_inputs``: the sources,
torch's version, the include paths, the compiler, the flags, Python), so that environments
sharing a home folder each keep their own build instead of rebuilding each other's (torch's
``build.ninja`` names the environment's include paths); later processes load the built
library in milliseconds. The platform decides whether they are used
(``platform.native_kernels``) and which instruction-set tier is built (``platform.isa``,
``llmkit.kernels.cpu_isa``): one library per tier, each under its own op namespace
``torch.ops.llmkit_cpu_<tier>``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from llmkit.config.paths import cache_dir
from llmkit.config import cpu_isa
from llmkit.config.cpu_isa import cpu_flags  # noqa: F401  (re-exported: callers read it here)
from llmkit.startup import startup_step

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu")
LIBRARY = "llmkit_cpu"


class CpuKernelBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded here (the message says why)."""


def compile_flags(tier: str | None = None) -> list[str]:
    """The build's flags for ``tier`` (default: this CPU's best; ``cpu_isa``).
    ``-ffp-contract=off``: no fused multiply-adds where torch's element-wise ops round the
    product first (the kernels must round where the op sequence they replace rounds). Without
    AVX2 ATen's ``Vectorized`` falls back to plain loops. ``LLMKIT_OPS`` names the tier's op
    namespace, so that builds of several tiers can be loaded in one process."""
    tier = cpu_isa.best_tier() if tier is None else tier
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", f"-DLLMKIT_OPS={op_namespace(tier)}"]
    if tier is not None:
        flags += cpu_isa.compile_flags(tier)
    return flags


def op_namespace(tier: str | None) -> str:
    """``torch.ops.<this>``: the op library of ``tier``'s build."""
    return f"{LIBRARY}_{tier or 'generic'}"


LINK_FLAGS = ("-fopenmp",)


@functools.cache
def compiler_identity() -> str:
    """The C++ compiler torch's builder runs (``$CXX`` or ``c++``): its resolved path and the
    first line of its ``--version``."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or cxx
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.partition("\n")[0]
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    return f"{os.path.realpath(path)} {version}"


def include_paths() -> list[str]:
    """Every include folder of the build, as torch's builder writes them into build.ninja:
    torch's (inside this environment), Python's, and the kernels' own."""
    from torch.utils import cpp_extension

    return [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(SOURCE_DIR)]


def build_inputs(flags: list[str]) -> dict[str, str]:
    """Everything the built library depends on; the build folder is keyed by all of it."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return {"sources": digest.hexdigest(), "torch": torch.__version__,
            "include_paths": os.pathsep.join(include_paths()),
            "compiler": compiler_identity(), "flags": " ".join([*flags, *LINK_FLAGS]),
            "python": f"{sys.implementation.cache_tag} {sysconfig.get_platform()}"}


def _build_key(inputs: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(inputs):
        digest.update(f"{name}={inputs[name]}\0".encode())
    return digest.hexdigest()[:16]


def build_directory(key: str) -> Path:
    return cache_dir() / "cpu_kernels" / key


def _first_error(exc: BaseException) -> str:
    """The compiler's first error line, else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [repr(exc)])[0 if errors else -1]


def kernels_build_key(tier: str | None = None) -> str:
    """The key of the kernels this process builds or loads for ``tier`` (default: the CPU's
    best; their sources, torch, compiler, flags): what a compiled graph calling them depends
    on."""
    return _tier_build_key(cpu_isa.best_tier() if tier is None else tier)


@functools.cache
def _tier_build_key(tier: str | None) -> str:
    return _build_key(build_inputs(compile_flags(tier)))


def load_cpu_kernels(tier: str | None = None):
    """``torch.ops.llmkit_cpu_<tier>`` once the tier's library is built (or found in the
    cache) and loaded; ``tier`` defaults to this CPU's best (``cpu_isa.best_tier``).

    Raises ``CpuKernelBuildError`` with the reason when it cannot be built here.
    """
    return _load_tier(cpu_isa.best_tier() if tier is None else tier)


@functools.cache  # per tier: a library's op namespace can be registered once per process
def _load_tier(tier: str | None):
    from torch.utils import cpp_extension

    key = kernels_build_key(tier)
    directory = build_directory(key)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        with startup_step(f"building llmkit's C++ CPU kernels for {tier or 'generic x86'} "
                          "(once per environment and tier; 20-40 s on 2 cores)"):
            cpp_extension.load(
                name=f"{LIBRARY}_{key}", sources=[str(SOURCE_DIR / "ops.cpp")],
                extra_cflags=compile_flags(tier),
                # a copy: the builder appends torch's libraries to the list it is given, which
                # changed the next tier's build key (a rebuild per process)
                extra_ldflags=list(LINK_FLAGS),
                extra_include_paths=[str(SOURCE_DIR)], build_directory=str(directory),
                is_python_module=False, with_cuda=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # compiler or ninja missing, or a build error
        raise CpuKernelBuildError(f"building llmkit's CPU kernels ({tier}) in {directory} "
                                  f"failed: {_first_error(exc)}") from exc
    logger.info("llmkit CPU kernels (%s) ready in %.1f s (%s)", tier,
                time.perf_counter() - t0, directory)
    namespace = op_namespace(tier)
    _register_fakes(namespace)
    _LOADED.append(tier)
    return getattr(torch.ops, namespace)


#: Tiers loaded in this process, in load order.
_LOADED: list[str | None] = []


def any_loaded_cpu_kernels():
    """The kernels of the first tier this process loaded (else the CPU's best): for the
    layout ops (repacking, dequantizing) that compute the same bits in every tier, so that a
    process running a forced tier does not build a second one for them."""
    return load_cpu_kernels(_LOADED[0] if _LOADED else None)


def _register_fakes(lib: str) -> None:
    """Output shapes of each op of namespace ``lib`` for tracing (fake tensors): what
    ``torch.compile`` needs to treat the kernels as opaque calls in a graph."""
    fake = torch.library.register_fake

    @fake(f"{lib}::rms_norm")
    def _rms_norm(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake(f"{lib}::fused_add_rms_norm")
    def _fused_add_rms_norm(x, residual, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake(f"{lib}::silu_and_mul")
    def _silu_and_mul(x):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @fake(f"{lib}::linear")
    def _linear(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @fake(f"{lib}::bf16_tile_linear")
    def _bf16_tile_linear(x, packed, out_features, bias):
        return x.new_empty(x.shape[0], out_features)

    @fake(f"{lib}::rotary_embedding_")
    def _rotary(x, cos_sin):
        return None

    @fake(f"{lib}::reshape_and_cache")
    def _reshape_and_cache(key, value, kv_cache, slot_mapping):
        return None

    @fake(f"{lib}::quant_linear")
    def _quant_linear(x, packed, format, out_features, scales=None, bias=None,
                      float_activations=False, portable=False):
        return x.new_empty(x.shape[0], out_features)

    @fake(f"{lib}::quant_dequantize")
    def _quant_dequantize(packed, format, out_features, in_features, scales=None, rows=None):
        n = out_features if rows is None else rows.shape[0]
        return packed.new_empty(n, in_features, dtype=torch.float32)

    @fake(f"{lib}::lora_add_")
    def _lora_add(y, x, lora_a, lora_b, row_slots, ranks, out_offsets):
        return None

    @fake(f"{lib}::lora_embedding_add_")
    def _lora_embedding_add(y, ids, lora_a, lora_b, row_slots, ranks):
        return None

    @fake(f"{lib}::ssm_state_update")
    def _ssm_state_update(x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, dt_min,
                          dt_max):
        return x.new_empty(x.shape, dtype=torch.float32)

    @fake(f"{lib}::paged_decode_attention")
    def _paged_decode_attention(q, kv_cache, block_table, seq_lens, scale, sliding_window=0,
                                soft_cap=0.0):
        return q.new_empty(q.shape)

    @fake(f"{lib}::write_latent_cache")
    def _write_latent_cache(latent, latent_cache, slot_mapping):
        return None

    @fake(f"{lib}::mla_decode_attention")
    def _mla_decode_attention(q_latent, q_pe, latent_cache, block_table, seq_lens, scale):
        return q_latent.new_empty(q_latent.shape)
