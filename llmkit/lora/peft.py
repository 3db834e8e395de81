"""Loading PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

What is read: ``r``, ``lora_alpha``, ``use_rslora`` (scaling ``lora_alpha / sqrt(r)`` instead of
``lora_alpha / r``), ``alpha_pattern`` (per-module alphas; ranks come from the tensors, so
``rank_pattern`` needs nothing more), and every tensor ``<module>.lora_A.weight`` /
``lora_B.weight`` (linear layers) or ``<module>.lora_embedding_A`` / ``lora_embedding_B``
(the token embedding). Copies of base weights that PEFT saves beside an adapter of the
embedding or LM head (``<module>.base_layer.weight``, its ``save_embedding_layers``) are checked
for shape and otherwise not used: the adapter applies to the served base model.

Refused, each with a message naming the file and what is wrong: a missing or unreadable file,
another PEFT method than LoRA, DoRA, LoRA biases, ``modules_to_save`` or trainable tokens (those
replace base weights), ``fan_in_fan_out``, a module the model has no LoRA layer for, a shape
that does not fit the base layer, and a rank above ``lora.max_lora_rank``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmkit.lora.base import LoRAAdapter, LoRALayerWeights, LoRALoadError, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\."
                  r"(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|base_layer)"
                  r"(?:\.default)?(?:\.weight)?$")


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """A module an adapter may target, as the model built it: ``in_features`` and
    ``out_features`` of its weight (an embedding: vocabulary and hidden size)."""

    name: str
    in_features: int
    out_features: int
    embedding: bool = False


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's ``get_pattern_key``: a key matches a module whose name ends with it (regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: Path) -> dict:
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRALoadError(f"LoRA adapter folder {str(path)!r} does not exist")
    if not cfg_file.is_file():
        raise LoRALoadError(f"{str(path)!r} is not a PEFT adapter folder: no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRALoadError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(f"{cfg_file}: expected a JSON object")
    return cfg


def _check_config(cfg: dict, where: Path) -> tuple[float, bool, dict]:
    def refuse(what: str) -> LoRALoadError:
        return LoRALoadError(f"{where / CONFIG_FILE}: {what} is not supported")

    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type {peft_type!r} (only LORA)")
    if cfg.get("use_dora"):
        raise refuse("use_dora (DoRA)")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise refuse(f"bias {cfg.get('bias')!r} (LoRA biases; only bias: none)")
    if cfg.get("modules_to_save"):
        raise refuse(f"modules_to_save {cfg['modules_to_save']} (it replaces base weights)")
    if cfg.get("trainable_token_indices"):
        raise refuse("trainable_token_indices (new token embeddings)")
    if cfg.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out (transposed weights)")
    if cfg.get("layer_replication"):
        raise refuse("layer_replication")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1:
        raise LoRALoadError(f"{where / CONFIG_FILE}: 'r' must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRALoadError(f"{where / CONFIG_FILE}: 'lora_alpha' must be a number, got "
                            f"{alpha!r}")
    return float(alpha), bool(cfg.get("use_rslora", False)), dict(cfg.get("alpha_pattern") or {})


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise LoRALoadError(f"{str(path)!r}: adapter_model.bin (pickle) is not supported; "
                                "save the adapter with safetensors (PEFT's default)")
        raise LoRALoadError(f"{str(path)!r}: no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRALoadError(f"{file}: not a readable safetensors file ({e})") from None


def load_peft_adapter(request: LoRARequest, targets: dict[str, LoRATarget], *,
                      max_rank: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> LoRAAdapter:
    """Read and check the adapter at ``request.lora_path`` against the model's ``targets``
    (by module name); returns it in ``dtype`` on ``device`` with the scaling folded into B."""
    path = Path(request.lora_path).expanduser()
    cfg = read_adapter_config(path)
    alpha, rslora, alpha_pattern = _check_config(cfg, path)
    tensors = _read_tensors(path)
    file = path / WEIGHTS_FILE
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRALoadError(f"{file}: unexpected tensor {key!r} (a LoRA adapter holds "
                                "<module>.lora_A.weight / lora_B.weight pairs)")
        module, kind = m["module"], m["kind"]
        if module not in targets:
            supported = sorted({t.rsplit(".", 1)[-1] for t in targets})
            raise LoRALoadError(f"{file}: the adapter targets {module!r}, which this model "
                                f"has no LoRA layer for (target modules supported: "
                                f"{', '.join(supported)})")
        if kind == "base_layer":
            t = targets[module]
            want = (t.out_features if not t.embedding else t.in_features,
                    t.in_features if not t.embedding else t.out_features)
            if tuple(tensor.shape) != want:
                raise LoRALoadError(f"{file}: {key} has shape {tuple(tensor.shape)}, the base "
                                    f"model's is {want} (an adapter for another base model?)")
            continue
        pairs.setdefault(module, {})[kind] = tensor
    adapter = LoRAAdapter(request)
    for module, got in sorted(pairs.items()):
        t = targets[module]
        a_key, b_key = (("lora_embedding_A", "lora_embedding_B") if t.embedding
                        else ("lora_A", "lora_B"))
        if a_key not in got or b_key not in got:
            have = ", ".join(sorted(got))
            raise LoRALoadError(f"{file}: module {module!r} needs {a_key} and {b_key} "
                                f"(found {have}){' (an embedding takes lora_embedding_A/B)' if t.embedding else ''}")
        a, b = got[a_key], got[b_key]
        rank = int(a.shape[0]) if a.dim() == 2 else -1
        want_a, want_b = (rank, t.in_features), (t.out_features, rank)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoRALoadError(
                f"{file}: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the "
                f"base layer (in {t.in_features}, out {t.out_features}: A must be "
                f"[r, {t.in_features}] and B [{t.out_features}, r]); an adapter for another "
                "base model?")
        if rank > max_rank:
            raise LoRALoadError(f"{file}: {module} has rank {rank}, above lora.max_lora_rank "
                                f"({max_rank}); raise lora.max_lora_rank")
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        adapter.layers[module] = LoRALayerWeights(
            lora_a=a.to(device=device, dtype=torch.float32).to(dtype).contiguous(),
            lora_b=(b.to(device=device, dtype=torch.float32) * scale).to(dtype).contiguous())
    if not adapter.layers:
        raise LoRALoadError(f"{file}: no LoRA weights in the file")
    return adapter
