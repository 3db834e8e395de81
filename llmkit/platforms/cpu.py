from __future__ import annotations

import logging
import os

import torch

from llmkit.compilation.base import StepGraphs
from llmkit.config.paths import cache_dir
from llmkit.config.schema import CompilationConfig
from llmkit.config import cpu_isa
from llmkit.config.cpu_dispatch import (CpuDispatch, dispatch_for_tier, dispatch_sources,
                                        resolve_dispatch)
from llmkit.linear.base import LinearMethod, LinearMethodFactory
from llmkit.linear.cpu_linear import CpuLinearMethod
from llmkit.ops.base import ModelOps
from llmkit.ops.cpu_ops import CpuNativeOps
from llmkit.platforms.base import Platform

logger = logging.getLogger(__name__)


def has_native_bf16(tier: str | None = None) -> bool:
    """AMX or AVX-512-BF16 in ``tier`` (default: this CPU's best): bf16 matmuls run at least
    as fast as float32."""
    tier = cpu_isa.best_tier() if tier is None else tier
    return tier is not None and cpu_isa.tier(tier).native_bf16


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    default_attention = "cpu"
    dist_backend = "gloo"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._native: dict[torch.dtype, object] = {}
        #: The instruction-set tier of the kernels and of every choice made from the CPU's
        #: flags (``platform.isa``; None: no AVX2, so no kernels).
        self.isa = cpu_isa.resolve_tier(config.isa)
        #: The tier's dispatch table with ``platform.dispatch``'s overrides: every row count
        #: at which a component this platform builds switches kernels.
        self.dispatch: CpuDispatch = resolve_dispatch(self.isa, config.dispatch)
        #: Each field's source (tier, calibrated, given); the speed-only fields are calibrated
        #: when the kernels load (``platform.calibrate``).
        self.dispatch_sources: dict[str, str] = dispatch_sources(config.dispatch)
        self._tuned = False

    # -- model.dtype=auto --------------------------------------------------------------------
    def preferred_dtype(self) -> torch.dtype:
        """The faster dtype here for what llmkit runs (decode is bound by the bytes it reads,
        prefill and large batches by GEMMs): bf16 where the CPU computes it natively (AMX /
        AVX-512-BF16), and on AVX2 CPUs with llmkit's C++ kernels, whose linear streams bf16
        weights for a few rows (``dispatch.linear_small_batch_max_rows``; one-sequence decode
        ~2x float32's speed) while larger batches and prefill compute bf16 layers in float32
        (packed copies): the same GEMMs as float32. float32 without those kernels: torch
        emulates bf16 matmuls on AVX2. (``benchmarks/cpu_dtype_bench.py`` compares the two.)"""
        if has_native_bf16(self.isa):
            return torch.bfloat16
        if self._native_bf16_linear_available():
            logger.info("model.dtype=auto: bfloat16 (llmkit's C++ kernels decode bf16 on this "
                        "AVX2 CPU; model.dtype=float32 for float32)")
            return torch.bfloat16
        logger.info("model.dtype=auto: float32 (no native bf16 here, and no C++ kernels; set "
                    "model.dtype=bfloat16 to force bf16)")
        return torch.float32

    def _native_bf16_linear_available(self) -> bool:
        if self.config.native_kernels == "off" or self.isa is None:
            return False
        return self.native_kernels(torch.bfloat16) is not None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def ops(self, dtype: torch.dtype) -> ModelOps:
        kernels = self.native_kernels(dtype)
        if kernels is None:
            return ModelOps()
        widen = dtype == torch.bfloat16 and not has_native_bf16(self.isa)  # MoE experts' GEMMs
        return CpuNativeOps(kernels, widen_bf16=widen)

    def linear_method_factory(self, dtype: torch.dtype) -> LinearMethodFactory:
        # oneDNN packs float32 on any x86 CPU. bf16 it packs only with AVX-512/AVX-NE-CONVERT,
        # and without native bf16 math every bf16 GEMM is emulated: there bf16 linears run in
        # float32 (same products, float32 accumulation, outputs rounded to bf16).
        kernels = self.native_kernels(dtype)
        pack = self.config.packed_linear and torch.backends.mkldnn.is_available()
        widen = pack and dtype == torch.bfloat16 and not has_native_bf16(self.isa)
        pack_bf16 = pack and dtype == torch.bfloat16 and has_native_bf16(self.isa)
        # the amx tier: bf16 layers on llmkit's AMX-BF16 tiles (a row's bits at any batch)
        tiles = pack and kernels is not None and dtype == torch.bfloat16 and self.isa == "amx"
        dispatch = self.dispatch
        return lambda spec: CpuLinearMethod(kernels, pack=pack, widen_bf16=widen,
                                            pack_bf16=pack_bf16, bf16_tiles=tiles,
                                            dispatch=dispatch)

    def quantized_linear_method_factory(self, dtype: torch.dtype, mode: str
                                        ) -> LinearMethodFactory | str:
        if dtype not in (torch.float32, torch.bfloat16):
            return f"the quantized kernels take float32 or bfloat16 activations, not {dtype}"
        kernels = self.native_kernels(dtype)
        if kernels is None or not hasattr(kernels, "quant_linear"):
            return ("the quantized kernels are llmkit's C++ CPU kernels, which are off or did "
                    "not build here (platform.native_kernels)")
        from llmkit.linear.quantized import quantized_method_factory

        return quantized_method_factory(mode, self.linear_method_factory(dtype), kernels)

    def graph_rows(self, model: torch.nn.Module, max_num_seqs: int) -> int:
        """The most rows a decode step graph covers: ``dispatch.step_graph_max_rows`` and
        ``max_num_seqs``, lowered to the rows every linear layer of ``model`` keeps one path
        (``LinearMethod.graph_max_rows``: a quantized layer at any count, the C++ float linear
        up to ``linear_small_batch_max_rows``); a layer whose method does not say keeps
        ``linear_small_batch_max_rows``. The LM head is not in the graph. A graph dynamic in its
        rows traces one path of each layer, so past a layer's switch it would compute other
        bits than eager. Fixed by the tier's table and the model's layers: the same at every
        start."""
        rows = min(self.dispatch.step_graph_max_rows, max_num_seqs)
        head = getattr(model, "lm_head", None)  # compute_logits runs it outside the graph
        for module in model.modules():
            method = getattr(module, "method", None)
            if isinstance(method, LinearMethod) and module is not head:
                held = method.graph_max_rows
                rows = min(rows, self.dispatch.linear_small_batch_max_rows if held is None
                           else held)
        return max(1, rows)

    def step_graphs(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                    config: CompilationConfig, max_num_seqs: int) -> StepGraphs | None:
        """Decode steps of up to :meth:`graph_rows` rows compiled by inductor (the graph
        needs the C++ kernels: with torch ops the attention backend has no graph-safe
        decode)."""
        if config.mode != "graphs":
            return None
        if not model.attn_backend.supports_step_graphs:
            logger.warning("compilation.mode=graphs: attention backend %r (ops %r) has no "
                           "graph-safe decode path; decode steps run eagerly",
                           model.attn_backend.name, model.ctx.ops.name)
            return None
        from llmkit.compilation.inductor import InductorStepGraphs
        from llmkit.kernels.cpu_native import kernels_build_key

        cache = config.cache_dir or str(cache_dir() / "compile")
        return InductorStepGraphs(model, kv_caches, self.graph_rows(model, max_num_seqs),
                                  cpp_wrapper=config.cpp_wrapper, cache_dir=cache,
                                  kernels_key=kernels_build_key(self.isa))

    def native_kernels(self, dtype: torch.dtype):
        # Asked by ops() and linear_method_factory(): build (or warn about a failed build) once.
        if dtype not in self._native:
            self._native[dtype] = self._load_native_kernels(dtype)
        return self._native[dtype]

    def _load_native_kernels(self, dtype: torch.dtype):
        mode = self.config.native_kernels
        if mode == "off":
            return None
        if dtype not in (torch.float32, torch.bfloat16):
            if mode == "on":
                raise ValueError(f"platform.native_kernels=on: the CPU kernels compute float32 "
                                 f"and bfloat16 models, not {dtype} (allowed here: auto, off)")
            return None
        from llmkit.kernels.cpu_native import CpuKernelBuildError, load_cpu_kernels

        try:
            # (no tier: a CPU without AVX2 gets the kernels' portable build, as before tiers)
            kernels = load_cpu_kernels(self.isa)
        except CpuKernelBuildError as exc:
            if mode == "on":
                raise ValueError(f"platform.native_kernels=on: {exc}") from exc
            logger.warning("%s; computing with torch ops instead (slower decoding; "
                           "platform.native_kernels=off silences this)", exc)
            return None
        self._tune(kernels)
        return kernels

    def _tune(self, kernels) -> None:
        """The table's speed-only fields: calibrated (or read from the calibration cached with
        the kernel build) unless given, then handed to the kernels. Once per platform."""
        if self._tuned:
            return
        self._tuned = True
        from llmkit.kernels.cpu_native import build_directory, kernels_build_key
        from llmkit.kernels.cpu_calibration import apply_tuning, calibrated_fields

        overrides = self.config.dispatch
        given = {name for name, source in dispatch_sources(overrides).items()
                 if source == "given"}
        key = kernels_build_key(self.isa)
        calibrated = calibrated_fields(kernels, self.isa, dispatch_for_tier(self.isa),
                                       self.config.calibrate, given,
                                       build_directory(key), key)
        self.dispatch = resolve_dispatch(self.isa, overrides, calibrated)
        self.dispatch_sources = dispatch_sources(overrides, calibrated)
        apply_tuning(kernels, self.dispatch)

    def apply_runtime_settings(self) -> None:
        threads = self.config.num_threads or len(os.sched_getaffinity(0))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
