"""A model's shape, read from its Hugging Face ``config.json`` without any weights: parameter
count, layers, heads, and the bytes one token's K/V costs.

``ModelShape.from_hf_config(cfg)`` takes a ``transformers.PretrainedConfig`` or a plain dict
(the JSON) and knows the Llama family's names (Llama, Mistral, Qwen2/3: ``hidden_size``,
``num_hidden_layers``, ...), GPT-2's (``n_embd``, ``n_layer``, ...) and mixture-of-experts
fields (``num_local_experts`` / ``num_experts``, ``num_experts_per_tok``).
``load_shape(name_or_path)`` reads a named shape shipped in
``llmkit/cost_model/shapes/NAME.json`` (so people can simulate models they do not have), a
``config.json``, or a model folder.

Counting (per layer, ``h`` hidden, ``n_h``/``n_kv`` heads of ``d`` dims, ``I`` intermediate):
attention ``h·n_h·d`` (q) + ``2·h·n_kv·d`` (k, v) + ``n_h·d·h`` (o); MLP ``3·h·I`` when gated
(SiLU-GLU: gate, up, down) else ``2·h·I``; norms ``2·h``. Plus the embedding ``V·h``, the LM
head ``V·h`` unless tied, and the final norm. Llama-2-7B: 6.74 B parameters, 13.5 GB in fp16.
KV bytes per token = ``2 (K and V) · layers · n_kv · d · dtype bytes`` (0.5 MiB for Llama-2-7B
in fp16) for full attention; each layer's KV-cache spec (``kv_specs``, read from the config by
``llmkit.models.kv_specs`` as the engine's models read it) prices MLA's latent, sliding windows
and recurrent states instead (``llmkit.cost_model.kv_footprint``). MLA attention (DeepSeek)
counts ``h·n_h·(d_nope + d_rope)`` for q (or ``h·r_q + r_q·n_h·(d_nope + d_rope)`` through its
LoRA), ``h·(r + d_rope)`` for the latent's down-projection, ``r·n_h·(d_nope + d_v)`` for its
up-projection and ``n_h·d_v·h`` for o.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from llmkit.attention.kv_spec import FullAttentionSpec, KVCacheSpec
from llmkit.models.kv_specs import kv_cache_specs_from_hf_config, spec_label
from llmkit.cost_model.kv_footprint import KVFootprint

__all__ = ["DTYPE_BYTES", "ModelShape", "ShapeError", "dtype_bytes", "load_shape",
           "shape_names", "shapes_dir"]

# Bytes per element of the dtypes the simulator knows.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


class ShapeError(ValueError):
    """A model config that lacks what the simulator needs, or a shape that does not exist."""


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ShapeError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def shapes_dir() -> Path:
    return Path(__file__).resolve().parent / "shapes"


def shape_names() -> list[str]:
    return sorted(p.stem for p in shapes_dir().glob("*.json"))


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    qkv_bias: bool = False
    # Mixture of experts: num_experts == 0 means a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # The checkpoint's dtype when its config says (``torch_dtype``), else None.
    checkpoint_dtype: str | None = None
    # What each layer keeps per request (whole model, tp = 1); empty: full attention.
    kv_specs: tuple[KVCacheSpec, ...] = ()
    # MLA (DeepSeek-V2/V3): kv_lora_rank > 0; q_lora_rank 0 = q projected directly
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE shared experts (DeepSeek, Qwen2-MoE's is counted as one expert-sized MLP each)
    num_shared_experts: int = 0

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: str | None = None) -> "ModelShape":
        h = _get(cfg, "hidden_size", "n_embd", "d_model")
        layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _get(cfg, "num_attention_heads", "n_head")
        if h is None or layers is None or heads is None:
            raise ShapeError("the model config needs hidden_size, num_hidden_layers and "
                             "num_attention_heads (or GPT-2's n_embd, n_layer, n_head)")
        kv_heads = _get(cfg, "num_key_value_heads", "n_head_kv", default=heads)
        head_dim = _get(cfg, "head_dim", default=None) or h // heads
        model_type = str(_get(cfg, "model_type", default="unknown"))
        gpt2_like = model_type in ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon",
                                   "starcoder2", "phi")
        inter = _get(cfg, "moe_intermediate_size", "intermediate_size", "n_inner", "ffn_dim")
        if inter is None:
            inter = 4 * h
        experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts",
                           default=0) or 0)
        per_tok = int(_get(cfg, "num_experts_per_tok", "num_experts_per_token",
                           default=0) or 0)
        vocab = _get(cfg, "vocab_size")
        if vocab is None:
            raise ShapeError("the model config has no vocab_size")
        eos = _get(cfg, "eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else
                                         ([] if eos is None else [eos])))
        dtype = _get(cfg, "torch_dtype", "dtype")
        dtype = str(dtype).replace("torch.", "") if dtype is not None else None
        if name is None:
            name = str(_get(cfg, "_name_or_path", "name_or_path", default="") or model_type)
        try:
            specs = tuple(kv_cache_specs_from_hf_config(cfg))
        except TypeError:
            specs = ()  # not the Llama family's names (GPT-2's n_head ...): full attention
        except ValueError as e:
            raise ShapeError(f"cannot read the KV-cache layout of {name!r}: {e}") from None
        return cls(
            name=name, model_type=model_type, hidden_size=int(h), num_layers=int(layers),
            num_heads=int(heads), num_kv_heads=int(kv_heads), head_dim=int(head_dim),
            intermediate_size=int(inter), vocab_size=int(vocab),
            max_position_embeddings=_get(cfg, "max_position_embeddings", "n_positions",
                                         "n_ctx"),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", default=gpt2_like)),
            gated_mlp=not gpt2_like,
            qkv_bias=bool(_get(cfg, "attention_bias", "qkv_bias", default=False)
                          or model_type in ("qwen2", "qwen2_moe", "gpt2")),
            num_experts=experts, num_experts_per_tok=per_tok if experts else 0,
            eos_token_ids=eos_ids,
            checkpoint_dtype=dtype if dtype in DTYPE_BYTES else None,
            kv_specs=specs if len(specs) == int(layers) else (),
            kv_lora_rank=int(_get(cfg, "kv_lora_rank", default=0)),
            q_lora_rank=int(_get(cfg, "q_lora_rank", default=0)),
            qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim", default=0)),
            qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim", default=0)),
            v_head_dim=int(_get(cfg, "v_head_dim", default=0)),
            num_shared_experts=int(_get(cfg, "n_shared_experts", default=0)) if experts else 0,
        )

    # -- parameters ------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.kv_lora_rank:
            n, r, rope = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
            qk = self.qk_nope_head_dim + rope
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk
                 if self.q_lora_rank else h * n * qk)
            return q + h * (r + rope) + r + r * n * (self.qk_nope_head_dim + self.v_head_dim) \
                + n * self.v_head_dim * h
        bias = (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h + bias

    @property
    def expert_params(self) -> int:
        """One MLP (one expert of an MoE layer)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def mlp_params_per_layer(self) -> int:
        if self.num_experts:
            return ((self.num_experts + self.num_shared_experts) * self.expert_params
                    + self.hidden_size * self.num_experts)
        return self.expert_params

    @property
    def layer_params(self) -> int:
        return self.attn_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter the checkpoint holds (embedding, layers, final norm, LM head)."""
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.embedding_params + self.num_layers * self.layer_params + self.hidden_size
                + head)

    def active_layer_params(self) -> int:
        """Parameters one token multiplies by in one layer (an MoE token uses k experts)."""
        if not self.num_experts:
            return self.layer_params
        return (self.attn_params_per_layer
                + (self.num_experts_per_tok + self.num_shared_experts) * self.expert_params
                + self.hidden_size * self.num_experts + 2 * self.hidden_size)

    def layer_params_read(self, num_tokens: int) -> float:
        """Parameters one layer reads from memory in a step of ``num_tokens`` tokens: all of
        them for a dense model; for an MoE, the experts that at least one token routes to, in
        expectation under uniform routing: ``E · (1 - (1 - k/E)^T)``."""
        if not self.num_experts:
            return float(self.layer_params)
        e, k = self.num_experts, self.num_experts_per_tok
        touched = e * (1.0 - (1.0 - k / e) ** max(num_tokens, 0))
        return (self.attn_params_per_layer
                + (touched + self.num_shared_experts) * self.expert_params
                + self.hidden_size * e + 2 * self.hidden_size)

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * dtype_bytes(dtype)

    # -- KV cache --------------------------------------------------------------------------
    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads one tensor-parallel rank holds (replicated when there are fewer than
        ``tp``)."""
        return max(1, -(-self.num_kv_heads // tp))

    @property
    def layer_kv_specs(self) -> tuple[KVCacheSpec, ...]:
        """One spec per layer (full attention when the config gave none)."""
        return self.kv_specs or (FullAttentionSpec(self.num_kv_heads, self.head_dim),) * \
            self.num_layers

    def with_mla(self, mode: str) -> "ModelShape":
        """This shape as ``model.mla=mode`` runs it: ``expanded`` keeps K and V per head (V
        padded to K's width, as ``llmkit.models.kv_specs.deepseek_kv_specs`` says) instead of
        the latent; a model without MLA, or ``absorbed``, is unchanged."""
        if mode != "expanded" or not self.kv_lora_rank:
            return self
        width = max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)
        return replace(self, kv_specs=(FullAttentionSpec(self.num_heads, width),)
                       * self.num_layers)

    def kv_footprint(self, dtype: str, tp: int = 1) -> KVFootprint:
        """The KV state by group on one rank (``llmkit.cost_model.kv_footprint``)."""
        return KVFootprint(self.layer_kv_specs, dtype, self.num_heads, tp)

    def kv_bytes_per_token(self, dtype: str, tp: int = 1) -> int:
        """What one more token of context costs in every layer, on one rank (``tp=1``: the
        whole model): K and V per KV head, MLA's latent row; 0 for a recurrent state, and a
        sliding window's layers count while the context is inside the window."""
        dtype_bytes(dtype)  # an unknown dtype is a ShapeError
        return int(self.kv_footprint(dtype, tp).kv_bytes_per_token)

    def summary(self, dtype: str) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["kv_specs"] = [spec_label(s) for s in self.layer_kv_specs]
        d.update(num_params=self.num_params, weight_bytes=self.weight_bytes(dtype),
                 kv_bytes_per_token=self.kv_bytes_per_token(dtype), dtype=dtype)
        return d


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ShapeError(f"cannot read the model config {str(path)!r}: {e}") from None


def load_shape(name_or_path: str) -> ModelShape:
    """A named shape (``llmkit/cost_model/shapes/NAME.json``), a ``config.json`` file, or a folder
    holding one. (A ``.gguf`` goes through ``llmkit.models.loader.resolve_model_source``.)"""
    named = shapes_dir() / f"{name_or_path}.json"
    if named.is_file():
        return ModelShape.from_hf_config(_read_json(named), name=name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelShape.from_hf_config(_read_json(path / "config.json"), name=path.name)
    if path.is_file() and path.suffix == ".json":
        return ModelShape.from_hf_config(_read_json(path), name=path.parent.name or path.stem)
    raise ShapeError(f"no model shape {name_or_path!r}: give a named shape "
                     f"({', '.join(shape_names())}), a config.json, or a model folder")
