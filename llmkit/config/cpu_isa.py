"""x86 instruction-set tiers of llmkit's C++ CPU kernels, and the one this CPU gets.

The kernels are compiled once per tier (``llmkit.kernels.cpu_native``), each tier's library
registered under its own op namespace (``torch.ops.llmkit_cpu_<tier>``), so a process can load
the tier it runs and, in tests, the lower ones beside it. Tiers are cumulative: each one's code
paths include those below (an AVX-512 VNNI build uses the 256-bit VNNI dot products of AVX-VNNI
through their EVEX encoding), so forcing a lower tier is always possible on a CPU that has a
higher one; the CPU's own flags (``/proc/cpuinfo``) decide which tiers it supports.

``platform.isa=auto`` picks the highest supported tier; a named tier forces it (a tier the CPU
lacks is a configuration error). A forced tier covers llmkit's kernels and the choices llmkit
makes from the CPU's flags (``model.dtype=auto``, which linear path bf16 takes); torch's own
oneDNN/ATen kernels follow the CPU unless ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` are
set before torch loads.

``amx`` adds AMX-INT8 tile kernels (``kernels/cpu/amx_quant_linear.h``: the quantized linears
of many rows) to the AVX-512 BF16 tier; Linux lends a process the tile state only on request, so
the tier also needs that request granted (``amx_tile_state_granted``). aarch64 (NEON, dotprod, SVE) would be further tiers in this table with their own compile
flags; none is built yet, as no such machine was available to test them.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuTier:
    name: str
    #: ``/proc/cpuinfo`` flags the CPU must show.
    requires: frozenset[str]
    #: compiler flags (GCC/Clang spelling) of this tier's build, added to those below it
    flags: tuple[str, ...]
    #: int8 dot products by VNNI (``vpdpbusd``) instead of AVX2's maddubs + madd pairs
    vnni: bool = False
    #: the CPU computes bf16 natively (AVX512-BF16 or AMX): bf16 GEMMs are not emulated
    native_bf16: bool = False
    #: llmkit has kernels of this tier's own (a tier without them is never picked or built)
    implemented: bool = True


_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}

#: Lowest first. ATen's ``Vectorized<float>`` stays 8 lanes wide in every tier: the float
#: kernels sum in the order of torch's AVX2 kernels, which is what their bit-equality with
#: Hugging Face's ops rests on; the wider tiers add integer dot products and instructions.
TIERS: tuple[CpuTier, ...] = (
    CpuTier("avx2", _AVX2, ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2",
                            "-DCPU_CAPABILITY=AVX2")),
    CpuTier("avx2_vnni", _AVX2 | {"avx_vnni"}, ("-mavxvnni", "-DLLMKIT_VNNI=1"), vnni=True),
    CpuTier("avx512", _AVX512, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                                "-DLLMKIT_AVX512=1")),
    CpuTier("avx512_vnni", _AVX512 | {"avx512_vnni"}, ("-mavx512vnni", "-DLLMKIT_VNNI=1"),
            vnni=True),
    CpuTier("avx512_bf16", _AVX512 | {"avx512_vnni", "avx512_bf16"},
            ("-mavx512bf16", "-DLLMKIT_AVX512_BF16=1"), vnni=True, native_bf16=True),
    CpuTier("amx", _AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
            ("-mamx-tile", "-mamx-int8", "-mamx-bf16", "-DLLMKIT_AMX=1"), vnni=True,
            native_bf16=True),
)
TIER_NAMES: tuple[str, ...] = tuple(t.name for t in TIERS)
_BY_NAME = {t.name: t for t in TIERS}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return frozenset()
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for logs and cache keys."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # not Linux: unknown
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


#: Linux's arch_prctl request for a state component, and AMX's tile data component.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def amx_tile_state_granted() -> bool:
    """Whether Linux grants this process AMX's tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, kernel 5.16+): without it a tile instruction kills the process. The
    request is the one the amx kernels make themselves; granting it twice is harmless."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _os_lends(t: CpuTier) -> bool:
    return "amx_tile" not in t.requires or amx_tile_state_granted()


def tier(name: str) -> CpuTier:
    return _BY_NAME[name]


def supported_tiers(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The tiers a CPU with ``flags`` (default: this one's) runs, lowest first."""
    flags = cpu_flags() if flags is None else flags
    out: list[str] = []
    for t in TIERS:
        if t.implemented and t.requires <= flags and _os_lends(t):
            out.append(t.name)
    return tuple(out)


def best_tier(flags: frozenset[str] | None = None) -> str | None:
    """The highest supported tier, or None where the CPU has not even AVX2 (no kernels)."""
    tiers = supported_tiers(flags)
    return tiers[-1] if tiers else None


def why_unsupported(requested: str, flags: frozenset[str] | None = None) -> str | None:
    """None when tier ``requested`` runs here, else what is allowed and why it is not (the
    "allowed" half of a config error)."""
    flags = cpu_flags() if flags is None else flags
    allowed = "auto" + "".join(", " + a for a in supported_tiers(flags))
    if requested not in _BY_NAME:
        return f"auto or a CPU tier: {', '.join(TIER_NAMES)}"
    if not _BY_NAME[requested].implemented:
        return f"a tier llmkit has kernels for: {allowed} (none of {requested}'s own yet)"
    missing = sorted(_BY_NAME[requested].requires - flags)
    if missing:
        return f"a tier this CPU supports: {allowed} (it lacks {', '.join(missing)})"
    if not _os_lends(_BY_NAME[requested]):
        return (f"a tier this CPU supports: {allowed} (the Linux kernel refuses this process "
                "AMX's tile state: arch_prctl(ARCH_REQ_XCOMP_PERM) needs Linux 5.16+)")
    return None


def resolve_tier(requested: str, flags: frozenset[str] | None = None) -> str | None:
    """``platform.isa``'s value made a tier: ``auto`` is the best one (None without AVX2); a
    named tier must be one this CPU supports (else ``ValueError`` naming the key)."""
    if requested == "auto":
        return best_tier(flags)
    problem = why_unsupported(requested, flags)
    if problem is not None:
        raise ValueError(f"platform.isa: got {requested!r}; allowed: {problem}")
    return requested


def compile_flags(name: str) -> list[str]:
    """The compiler flags of tier ``name``'s build: its own and every lower tier's."""
    flags: list[str] = []
    for t in TIERS:
        if t.name == "avx2_vnni" and name != "avx2_vnni":
            continue  # AVX-512 tiers take VNNI from their own extension (Cascade Lake has no AVX-VNNI)
        flags += t.flags
        if t.name == name:
            return flags
    raise ValueError(f"unknown CPU tier {name!r} (allowed: {', '.join(TIER_NAMES)})")
