"""A model's per-layer KV-cache specs read from its Hugging Face config, without building it.

One function per family maps a config to one ``KVCacheSpec`` per layer (all layers; a
pipeline stage slices its own). The models' ``kv_cache_specs()`` call these, and so do the
tools that must know a model's state without its weights (``llmkit sim``, ``llmkit config``,
the capacity benchmark), so the two can never disagree.

The config may be a ``transformers.PretrainedConfig`` or the raw ``config.json`` dict: for a
dict the defaults that the config classes fill in (Gemma 2's alternation, Gemma 3's
``sliding_window_pattern``, Qwen2's ``use_sliding_window`` / ``max_window_layers``, Bamba's
``mamba_d_head="auto"``) are applied here the same way.

Families:

- Llama and its kin (Mistral, Qwen2/3, Mixtral, ...): full attention; ``layer_types``
  (``"sliding_attention"``) or a ``sliding_window`` (all layers for Mistral; for Qwen2 the
  layers from ``max_window_layers`` on, when ``use_sliding_window``) makes sliding layers.
- Gemma 2 / 3: ``layer_types``, else every 2nd layer (Gemma 2) or every
  ``sliding_window_pattern``-th (Gemma 3, default 6) is global, the rest slide.
- DeepSeek-V2 / V3 (and Kimi K2): MLA on every layer, ``kv_lora_rank + qk_rope_head_dim``.
- Bamba (Mamba-2 hybrid): ``attn_layer_indices`` attend, the others keep a Mamba-2 state:
  conv ``[d_inner + 2·n_groups·d_state, d_conv − 1]`` and SSM ``[n_heads, head_dim, d_state]``.

Tensor parallel (``tp_size``): KV heads split over the ranks (replicated when fewer), Mamba
heads and groups split, the MLA latent is whole on every rank.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Callable

import torch

from llmkit.attention.kv_spec import (FullAttentionSpec, KVCacheSpec, MLASpec,
                                      RecurrentStateSpec, SlidingWindowSpec, layer_ranges)

__all__ = ["UnknownLayerTypeError", "bamba_kv_specs", "deepseek_kv_specs",
           "describe_kv_groups", "gemma_kv_specs", "kv_cache_groups",
           "kv_cache_specs_from_hf_config", "llama_kv_specs", "mamba2_state_shapes",
           "spec_label"]

SLIDING = "sliding_attention"
FULL = "full_attention"


class UnknownLayerTypeError(ValueError):
    """A ``layer_types`` entry this module cannot turn into a spec."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    v = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
    return default if v is None else v


def _text_config(cfg: Any) -> Any:
    """A multimodal wrapper's language model config (Gemma 3's ``text_config``)."""
    text = _get(cfg, "text_config")
    return text if text is not None else cfg


def _attention_spec(cfg: Any, tp_size: int) -> FullAttentionSpec:
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    head_dim = int(_get(cfg, "head_dim", 0) or _get(cfg, "hidden_size") // heads)
    return FullAttentionSpec(max(1, kv_heads // tp_size), head_dim)


def _from_layer_types(cfg: Any, layer_types: list[str], full: FullAttentionSpec
                      ) -> list[KVCacheSpec]:
    window = _get(cfg, "sliding_window")
    sliding = (SlidingWindowSpec(full.num_kv_heads, full.head_dim, sliding_window=int(window))
               if window else None)
    specs: list[KVCacheSpec] = []
    for i, kind in enumerate(layer_types):
        if kind == FULL or (kind == SLIDING and sliding is None):
            specs.append(full)
        elif kind == SLIDING:
            specs.append(sliding)
        else:
            raise UnknownLayerTypeError(
                f"layer_types[{i}]={kind!r}: known are {FULL!r} and {SLIDING!r}")
    return specs


def llama_kv_specs(cfg: Any, tp_size: int = 1) -> list[KVCacheSpec]:
    """Llama, Mistral, Qwen2/3 and the MoE models built on them."""
    cfg = _text_config(cfg)
    n = int(_get(cfg, "num_hidden_layers"))
    full = _attention_spec(cfg, tp_size)
    layer_types = _get(cfg, "layer_types")
    if layer_types is None:
        window = _get(cfg, "sliding_window")
        model_type = _get(cfg, "model_type", "")
        if model_type.startswith("qwen"):
            # Qwen2's config keeps the window only with use_sliding_window, and slides the
            # layers from max_window_layers on
            if not _get(cfg, "use_sliding_window", False):
                window = None
            first = int(_get(cfg, "max_window_layers", n))
        else:
            first = 0
        layer_types = [SLIDING if window and i >= first else FULL for i in range(n)]
    return _from_layer_types(cfg, list(layer_types), full)


def gemma_kv_specs(cfg: Any, tp_size: int = 1) -> list[KVCacheSpec]:
    """Gemma 2 and Gemma 3 (text, or the text part of the multimodal one)."""
    cfg = _text_config(cfg)
    return _from_layer_types(cfg, gemma_layer_types(cfg), _attention_spec(cfg, tp_size))


def gemma_layer_types(cfg: Any) -> list[str]:
    """Each Gemma layer's attention kind: the config's ``layer_types``, else the Hub's older
    pattern (every n-th layer full, the others sliding): Gemma 2 alternates, Gemma 3 keeps its
    ``sliding_window_pattern`` (5 local : 1 global)."""
    layer_types = _get(cfg, "layer_types")
    if layer_types:
        return list(layer_types)
    gemma2 = _get(cfg, "model_type", "") == "gemma2"
    pattern = 2 if gemma2 else int(_get(cfg, "sliding_window_pattern",
                                        _get(cfg, "_sliding_window_pattern", None)) or 6)
    return [SLIDING if (i + 1) % pattern else FULL
            for i in range(int(_get(cfg, "num_hidden_layers")))]


def deepseek_kv_specs(cfg: Any, tp_size: int = 1, mla: str = "absorbed") -> list[KVCacheSpec]:
    """DeepSeek-V2 / V3: one latent row per token per layer, whole on every rank; with
    ``model.mla=expanded``, K and V per head of this rank, V padded to K's width
    (``llmkit/models/layers/mla.py``)."""
    cfg = _text_config(cfg)
    rope = int(_get(cfg, "qk_rope_head_dim"))
    if mla == "expanded":
        width = max(int(_get(cfg, "qk_nope_head_dim")) + rope, int(_get(cfg, "v_head_dim")))
        spec = FullAttentionSpec(int(_get(cfg, "num_attention_heads")) // tp_size, width)
    else:
        spec = MLASpec(int(_get(cfg, "kv_lora_rank")), rope)
    return [spec] * int(_get(cfg, "num_hidden_layers"))


def mamba2_state_shapes(cfg: Any, tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
    """One request's Mamba-2 state on one rank: the causal conv's last ``d_conv − 1`` inputs
    over x, B and C (``[d_inner + 2·n_groups·d_state, d_conv − 1]``), and the SSM state
    ``[n_heads, head_dim, d_state]``."""
    hidden = int(_get(cfg, "hidden_size"))
    n_heads = int(_get(cfg, "mamba_n_heads"))
    expand = int(_get(cfg, "mamba_expand", 2))
    d_inner = expand * hidden
    head_dim = _get(cfg, "mamba_d_head", "auto")
    head_dim = d_inner // n_heads if head_dim == "auto" else int(head_dim)
    n_groups = int(_get(cfg, "mamba_n_groups", 1))
    d_state = int(_get(cfg, "mamba_d_state"))
    d_conv = int(_get(cfg, "mamba_d_conv", 4))
    groups = n_groups // tp_size if n_groups % tp_size == 0 else n_groups
    heads = n_heads // tp_size
    conv_dim = heads * head_dim + 2 * groups * d_state
    return ((conv_dim, d_conv - 1), (heads, head_dim, d_state))


def bamba_kv_specs(cfg: Any, tp_size: int = 1) -> list[KVCacheSpec]:
    """Bamba: full attention on ``attn_layer_indices``, a Mamba-2 state on the others."""
    cfg = _text_config(cfg)
    n = int(_get(cfg, "num_hidden_layers"))
    attn = set(_get(cfg, "attn_layer_indices", ()) or ())
    full = _attention_spec(cfg, tp_size)
    # float32 whatever the model's dtype: transformers keeps the SSM state its chunked scan
    # returns in float32 (a bf16 state would round at every token), and the conv's bf16
    # inputs are exact in float32
    state = RecurrentStateSpec(mamba2_state_shapes(cfg, tp_size), dtype=torch.float32)
    return [full if i in attn else state for i in range(n)]


_BY_MODEL_TYPE: dict[str, Callable[[Any, int], list[KVCacheSpec]]] = {
    "gemma2": gemma_kv_specs, "gemma3": gemma_kv_specs, "gemma3_text": gemma_kv_specs,
    "deepseek_v2": deepseek_kv_specs, "deepseek_v3": deepseek_kv_specs,
    "kimi_k2": deepseek_kv_specs,
    "bamba": bamba_kv_specs,
}


def kv_cache_specs_from_hf_config(cfg: Any, tp_size: int = 1,
                                  mla: str = "absorbed") -> list[KVCacheSpec]:
    """Every layer's spec for ``cfg`` (a ``PretrainedConfig`` or a ``config.json`` dict), by
    its ``model_type``; anything not listed is read as the Llama family. ``mla``:
    ``model.mla`` (how an MLA model keeps its KV)."""
    fn = _BY_MODEL_TYPE.get(str(_get(cfg, "model_type", "")), llama_kv_specs)
    if fn is deepseek_kv_specs:
        return fn(cfg, tp_size, mla)
    return fn(cfg, tp_size)


# -- describing the groups (llmkit config, start-up, llmkit sim) -------------------------------

def kv_cache_groups(specs: Sequence[KVCacheSpec]) -> list[tuple[KVCacheSpec, list[int]]]:
    """Layers with equal specs, in order of their first layer: the KV-cache groups."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    return list(groups.items())


def spec_label(spec: KVCacheSpec) -> str:
    """``FullAttention(num_kv_heads=8, head_dim=128)`` (a state's dtype only when fixed)."""
    args = ", ".join(f"{f.name}={getattr(spec, f.name)}" for f in fields(spec)
                     if not (f.name == "dtype" and getattr(spec, f.name) is None))
    return f"{type(spec).__name__.removesuffix('Spec')}({args})"


def describe_kv_groups(specs: Sequence[KVCacheSpec], dtype: torch.dtype,
                       block_size: int) -> list[str]:
    """One line per group: its spec, layers, and bytes per token and per block over all its
    layers (a recurrent state: bytes per request, one block each)."""
    lines = []
    for spec, layers in kv_cache_groups(specs):
        n = len(layers)
        if isinstance(spec, RecurrentStateSpec):
            cost = f"{n * spec.state_bytes(dtype)} B/request (one block)"
        else:
            cost = (f"{n * spec.bytes_per_token(dtype)} B/token, "
                    f"{n * spec.page_bytes(block_size, dtype)} B/block")
        lines.append(f"{spec_label(spec)}: layers {layer_ranges(layers, ',')} ({n}), {cost}")
    return lines
