"""Start-up checks of the ``parallel`` group against the model and the machine: one-line
``ConfigError``s naming the key, before any worker starts."""
from __future__ import annotations

import os

from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.models.moe import MoeShape, moe_shape
from llmkit.platforms.base import Platform

def distributed_backend(config: EngineConfig, platform: Platform) -> str:
    choice = config.parallel.distributed_backend
    if choice != "auto":
        return choice
    return "nccl" if platform.device.type == "cuda" else "gloo"


def max_ranks(platform: Platform) -> tuple[int, str]:
    """How many ranks this machine allows, and why."""
    if platform.device.type == "cuda":
        import torch
        n = torch.cuda.device_count()
        return n, f"{n} CUDA device(s)"
    # CPU ranks per usable core: the platform's dispatch table (platform.dispatch.ranks_per_core)
    per_core = (platform.dispatch or CpuDispatch()).ranks_per_core
    cores = len(os.sched_getaffinity(0))
    return per_core * cores, f"{per_core} per usable CPU core ({cores})"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_mlp_split(hf_config, moe: MoeShape | None, tp: int, expert_parallel: bool) -> None:
    """The MLP dimensions tensor parallel splits (a MoE model's experts: whole experts per
    rank under expert parallel, else every expert's intermediate dimension)."""
    key = "parallel.tensor_parallel_size"
    inter = getattr(hf_config, "intermediate_size", None)
    dense_layers = moe is None or len(moe.sparse_layers) < hf_config.num_hidden_layers
    if moe is not None and moe.shared_expert_intermediate_size % tp:
        size = moe.shared_expert_intermediate_size
        raise ConfigError(key, tp, f"a divisor of the model's shared_expert_intermediate_size "
                          f"{size} ({_divisors(size)})")
    if moe is not None and expert_parallel and moe.num_experts % tp:
        raise ConfigError(key, tp, f"a divisor of the model's {moe.num_experts} experts with "
                          f"parallel.enable_expert_parallel=true ({_divisors(moe.num_experts)})")
    if moe is not None and not expert_parallel and moe.expert_intermediate_size % tp:
        size = moe.expert_intermediate_size
        raise ConfigError(key, tp, f"a divisor of the experts' intermediate size {size} "
                          f"({_divisors(size)}), or parallel.enable_expert_parallel=true")
    if dense_layers and inter is not None and inter % tp:
        raise ConfigError(key, tp, f"a divisor of the model's intermediate_size {inter}")


def check_expert_parallel(config: EngineConfig, hf_config) -> None:
    """Expert parallel needs experts (checked for one worker too: it would do nothing)."""
    if config.parallel.enable_expert_parallel and moe_shape(hf_config) is None:
        raise ConfigError("parallel.enable_expert_parallel", True,
                          f"false for model_type {hf_config.model_type!r} (a dense model has no "
                          "experts to split; MoE models: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3)")


def check_parallel_config(config: EngineConfig, hf_config, platform: Platform) -> None:
    """Raise ``ConfigError`` where the sizes do not fit the model or the machine, or name what
    is not supported yet."""
    par = config.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    moe = moe_shape(hf_config)
    check_expert_parallel(config, hf_config)
    quant = config.model.quantization
    if quant not in ("auto", "none"):
        raise ConfigError("model.quantization", quant, "auto or none with several workers "
                          "(quantized weights are not split over ranks yet; auto dequantizes a "
                          "quantized checkpoint, with a warning)")
    if pp > 1:
        check_pipeline_parallel(config, hf_config)
    if distributed_backend(config, platform) == "nccl" and platform.device.type != "cuda":
        raise ConfigError("parallel.distributed_backend", "nccl", "auto or gloo on a CPU")
    world = par.world_size
    limit, why = max_ranks(platform)
    if world > limit:
        # the key of the size that went past (PP's when both are set and TP alone fits)
        over_pp = pp > 1 and tp <= limit
        raise ConfigError("parallel.pipeline_parallel_size" if over_pp
                          else "parallel.tensor_parallel_size", pp if over_pp else tp,
                          f"at most {limit} ranks in all on this machine ({why}); "
                          f"tensor_parallel_size * pipeline_parallel_size = {world}")
    _check_attention_split(hf_config, tp)
    _check_mlp_split(hf_config, moe, tp, par.enable_expert_parallel)
    if tp > 1:
        check_speculative_split(config)


def _check_attention_split(hf_config, tp: int, owner: str = "model's", note: str = "") -> None:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ConfigError("parallel.tensor_parallel_size", tp, f"a divisor of the {owner} "
                          f"{heads} attention heads ({_divisors(heads)}){note}")
    if kv_heads % tp and tp % kv_heads:
        raise ConfigError("parallel.tensor_parallel_size", tp,
                          f"a divisor or a multiple of the {owner} {kv_heads} KV heads{note}")


def check_speculative_split(config: EngineConfig) -> None:
    """A draft model or EAGLE head is split over the tensor-parallel ranks like the target
    (every rank runs it, with the rank's group): its heads and MLP must divide too."""
    spec = config.speculative
    if not spec.enabled or spec.target or spec.name not in ("draft_model", "eagle"):
        return
    if spec.name == "draft_model":
        from llmkit.spec_decode.draft_model import resolve_draft_source
        hf_config = resolve_draft_source(spec.model, 1).hf_config
        owner = "draft model's"
    else:
        from pathlib import Path

        from transformers import AutoConfig
        folder = Path(spec.model).expanduser()
        if not (folder / "config.json").is_file():
            return  # the proposer's own check names what is wrong
        hf_config = AutoConfig.from_pretrained(str(folder))
        owner = "EAGLE head's"
    tp = config.parallel.tensor_parallel_size
    note = f" (speculative.model={spec.model})"
    _check_attention_split(hf_config, tp, owner, note)
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise ConfigError("parallel.tensor_parallel_size", tp,
                          f"a divisor of the {owner} intermediate_size {inter}{note}")


def check_pipeline_parallel(config: EngineConfig, hf_config) -> None:
    """What pipeline parallel cannot serve (yet): too many stages, a model that does not
    split into stages, and the features that need every layer in one process."""
    from llmkit.models.registry import get_model_class

    pp = config.parallel.pipeline_parallel_size
    key = "parallel.pipeline_parallel_size"
    cls = get_model_class(hf_config)
    if not cls.supports_pp:
        raise ConfigError(key, pp, f"1 for {cls.__name__} (it does not split into pipeline "
                          "stages)")
    layers = hf_config.num_hidden_layers
    if pp > layers:
        raise ConfigError(key, pp, f"at most the model's {layers} layers (one per stage)")
    # LoRA's slots are built for every layer in one runner; a proposer runs every layer of
    # its draft after the target's last one. (KV connectors are refused by
    # kv_connector_class.)
    spec = config.speculative
    if spec.enabled or spec.target:
        raise ConfigError("speculative.name", spec.target or spec.name, "none with several "
                          f"workers in pipeline stages ({key}={pp}; speculative decoding runs "
                          "under tensor parallel, not across stages)")
    if config.lora.enabled:
        raise ConfigError("lora.enabled", True, f"false with {key}={pp} (LoRA adapters are "
                          "not served across pipeline stages)")
