"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

One class reads the variant from the config. Q, K and V come from one fused projection and gate
and up from another; the checkpoint's separate matrices are stacked into them at load time.
Module names otherwise follow Hugging Face's so that checkpoint names map one to one.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, Mapping

import torch
from torch import nn

from llmkit.attention.base import AttentionMetadata
from llmkit.attention.kv_spec import KVCacheSpec, SlidingWindowSpec
from llmkit.distributed.pipeline import IntermediateTensors
from llmkit.models.base import CausalLM, ModelContext
from llmkit.models.kv_specs import llama_kv_specs
from llmkit.models.layers.embedding import VocabEmbedding
from llmkit.models.layers.linear import Linear, MergedLinear
from llmkit.models.layers.moe import FusedMoE
from llmkit.models.layers.norm import RMSNorm
from llmkit.models.layers.pipeline import PPMissingLayer, is_pp_missing, make_layers
from llmkit.models.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from llmkit.ops.base import RotaryTables
from llmkit.linear.base import copy_weight

# (fused parameter, checkpoint module, shard id): vLLM's stacked_params_mapping.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


def fused_target(prefix: str) -> tuple[str, str | None]:
    """A checkpoint module name -> the fused layer that holds it and the shard id
    (``...self_attn.k_proj`` -> ``(...self_attn.qkv_proj, "k")``); others pass unchanged."""
    for fused, part, shard_id in STACKED_PARAMS:
        if prefix.endswith(f".{part}"):
            return prefix[:-len(part)] + fused, shard_id
    return prefix, None


def expected_linear_weights(linears: Mapping[str, Linear]) -> set[tuple[str, Hashable]]:
    """``(weight name, shard id)`` of every checkpoint tensor the ``Linear`` layers (by module
    name) load."""
    return {(f"{name}.{w}", shard) for name, layer in linears.items()
            for w, shard in layer.expected_weights()}


def load_linear_weight(linears: Mapping[str, Linear], name: str, tensor: torch.Tensor
                       ) -> tuple[str, Hashable] | None:
    """Load checkpoint weight ``name`` into the ``Linear`` layer that holds it (its shard of a
    fused one); what it loaded, as in :func:`expected_linear_weights`, or None when no
    ``Linear`` holds it."""
    module, _, attr = name.rpartition(".")
    prefix, shard = fused_target(module)
    layer = linears.get(prefix)
    if layer is None:  # a model that keeps this projection unfused (DeepSeek's q_proj)
        prefix, shard = module, None
        layer = linears.get(prefix)
    if layer is None:
        return None
    layer.load_weight(attr, tensor, shard)
    return f"{prefix}.{attr}", shard


def raise_if_missing(expected: set[tuple[str, Hashable]], loaded: set[tuple[str, Hashable]],
                     checkpoint: str = "checkpoint", owner: str = "model") -> None:
    """``ValueError`` naming (the first 8 of) the expected weights that were not loaded."""
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"the {checkpoint} lacks {len(missing)} weight(s) of the {owner}: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


# Qwen2 and the language models of Qwen2-VL / Qwen2.5-VL: biases on q, k, v (not o).
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
# Qwen3: per-head RMSNorm on q and k before the rope.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Checkpoint tensors that carry no parameter.
IGNORED_WEIGHTS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, rope, paged attention, output projection. What the Llama kin
    read from the config; the keywords are the variants' differences (Gemma 2/3): the score
    scale (default ``head_dim ** -0.5``), the per-head q/k norm class (default: RMSNorm for
    Qwen3, none otherwise), a sliding window and a soft-cap on the scores."""

    def __init__(self, config, prefix: str, ctx: ModelContext, *, scale: float | None = None,
                 qk_norm: type[RMSNorm] | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.attn_backend = ctx.attn_backend
        self.ops = ctx.ops
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = _head_dim(config)
        # This rank's heads (tensor parallel: the linear methods split q/k/v by heads; K/V
        # heads fewer than the ranks are replicated).
        self.num_heads = heads // ctx.tp.size
        self.num_kv_heads = max(1, kv_heads // ctx.tp.size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        # A sliding-window layer's window (Mistral, Qwen2's upper layers: set by
        # LlamaForCausalLM from the layer's KV-cache spec; Gemma's: given); None = full.
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or config.model_type in QKV_BIAS_MODEL_TYPES or \
            bool(getattr(config, "qkv_bias", False))  # qwen2_moe
        self.qkv_proj = MergedLinear(
            f"{prefix}.qkv_proj", config.hidden_size,
            {"q": heads * self.head_dim, "k": kv_heads * self.head_dim,
             "v": kv_heads * self.head_dim},
            bias=qkv_bias, dtype=ctx.dtype, linear_method=ctx.linear_method,
            shard_units=(heads, kv_heads, kv_heads))
        self.o_proj = Linear.build(f"{prefix}.o_proj", heads * self.head_dim, config.hidden_size,
                                   bias=attention_bias, dtype=ctx.dtype,
                                   linear_method=ctx.linear_method, parallel="row")
        if qk_norm is None and config.model_type in QK_NORM_MODEL_TYPES:
            qk_norm = RMSNorm
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps, ctx.dtype, ctx.ops)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps, ctx.dtype, ctx.ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RotaryTables, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n, h, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None:
            # Q and K rotate together: one op over their heads side by side.
            qk = self.ops.rotary(qkv[:, :qk_size].view(n, h + hkv, d), rope)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = self.ops.rotary(self.q_norm(qkv[:, :self.q_size].view(n, h, d)), rope)
            k = self.ops.rotary(self.k_norm(qkv[:, self.q_size:qk_size].view(n, hkv, d)), rope)
        v = qkv[:, qk_size:].view(n, hkv, d)
        if self.sliding_window is None and self.logits_soft_cap is None:
            o = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        else:
            o = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale,
                                          sliding_window=self.sliding_window,
                                          logits_soft_cap=self.logits_soft_cap)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    """The gated MLP, ``intermediate_size`` wide (default: the config's); ``reduce_results``
    False leaves a tensor-parallel down projection's partial sums to the caller's all-reduce
    (a MoE block's shared expert); ``act_fn`` replaces SiLU's gate (Gemma's GeGLU).

    SiLU's gate is the platform op itself (``ops.silu_and_mul``): a module around it would hold
    no weights and only forward the call, once per layer and step."""

    def __init__(self, config, prefix: str, ctx: ModelContext,
                 intermediate_size: int | None = None, reduce_results: bool = True,
                 act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        if act_fn is None:
            act = getattr(config, "hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise ValueError(f"hidden_act {act!r} is not supported by the Llama family "
                                 "implementation (only silu)")
            act_fn = ctx.ops.silu_and_mul
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(f"{prefix}.gate_up_proj", config.hidden_size,
                                         {"gate": inter, "up": inter}, bias=bias,
                                         dtype=ctx.dtype, linear_method=ctx.linear_method)
        self.act_fn = act_fn
        self.down_proj = Linear.build(f"{prefix}.down_proj", inter, config.hidden_size,
                                      bias=bias, dtype=ctx.dtype,
                                      linear_method=ctx.linear_method, parallel="row",
                                      reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Attention then an MLP, each after an RMSNorm, the residual add fused into the next norm.

    The variants' differences are arguments: ``mlp`` replaces the gated MLP (a MoE block:
    ``x [T, H] -> [T, H]``), ``attn`` Llama's attention (DeepSeek's MLA, Gemma's keywords),
    ``norm`` the RMSNorm (Gemma's ``1 + w``); ``sandwich`` adds Gemma 2/3's norms after the
    attention and around the MLP: ``x + post_attn(attn(input(x)))``, then
    ``+ post_ff(mlp(pre_ff(.)))``."""

    def __init__(self, config, prefix: str, ctx: ModelContext,
                 mlp: nn.Module | None = None, *, attn: nn.Module | None = None,
                 norm: type[RMSNorm] = RMSNorm, sandwich: bool = False) -> None:
        super().__init__()
        self.self_attn = attn if attn is not None else \
            LlamaAttention(config, f"{prefix}.self_attn", ctx)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, f"{prefix}.mlp", ctx)
        make_norm = lambda: norm(config.hidden_size, config.rms_norm_eps, ctx.dtype,  # noqa
                                 ctx.ops)
        self.input_layernorm = make_norm()
        self.post_attention_layernorm = make_norm()
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = make_norm()
            self.post_feedforward_layernorm = make_norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTables,
                kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, attn_metadata)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x),
                                                         residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


#: ``(config, prefix, ctx, layer_index) -> the layer's MLP``, or ``None`` for the gated MLP.
MlpFactory = Callable[[object, str, ModelContext, int], "nn.Module | None"]
#: ``(prefix) -> a layer's attention`` (``prefix``: its module name), in place of Llama's.
AttnFactory = Callable[[str], nn.Module]


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (this pipeline stage's), final norm and one rope table;
    ``make_attn`` gives each layer another attention (DeepSeek's MLA) and ``rope_dim`` the
    rotated width when it is not the head's (MLA's rope part)."""

    def __init__(self, config, prefix: str, ctx: ModelContext,
                 make_mlp: MlpFactory | None = None, make_attn: AttnFactory | None = None,
                 rope_dim: int | None = None) -> None:
        super().__init__()
        head_dim = rope_dim or _head_dim(config)
        pp = ctx.pp
        # Pipeline parallel: the first stage embeds; the last needs the matrix too when the LM
        # head is tied to it (vLLM's rule). Other stages' layers are absent (PPMissingLayer).
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if pp.is_first_rank or (tied and pp.is_last_rank):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size,
                                               ctx.dtype, ctx.tp)
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: LlamaDecoderLayer(
                config, f"{prefix}.layers.{i}", ctx,
                make_mlp and make_mlp(config, f"{prefix}.layers.{i}.mlp", ctx, i),
                attn=make_attn and make_attn(f"{prefix}.layers.{i}.self_attn")), pp)
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.norm = (RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.ops)
                     if pp.is_last_rank else PPMissingLayer())
        inv_freq, attention_scaling = compute_inv_freq(config, head_dim)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, inv_freq,
                                          attention_scaling, ctx.dtype,
                                          rope_parameters(config).get("mrope_section"))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            # The embedding is a fresh tensor this forward owns: the residual stream updates it.
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.clone()
            residual = None
        else:  # the previous stage's (received into fresh buffers this forward owns)
            x, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        rope = self.rotary_emb.lookup(positions)
        hook = attn_metadata.kv_layer_hook
        # kv_caches holds this stage's layers only, in order (KV connectors run without
        # pipeline stages, so a hook's layer index is the model's)
        # (indexed, not sliced: a ModuleList slice builds a new ModuleList every forward)
        for i, kv_cache in enumerate(kv_caches[:self.end_layer - self.start_layer]):
            layer = self.layers[self.start_layer + i]
            if hook is not None:  # a KV connector: layer i's loads land before it runs
                hook.wait_for_layer_load(i)
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata.for_layer(i))
            if hook is not None:
                hook.save_kv_layer(i, kv_cache)
        if not self.is_last_stage:
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """Registered for ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
    ``Qwen3ForCausalLM``."""

    #: the layers split into pipeline stages (``ModelContext.pp``)
    supports_pp = True
    packed_modules_mapping = {fused: [part for f, part, _ in STACKED_PARAMS if f == fused]
                              for fused, _, _ in STACKED_PARAMS}
    supports_kv_layer_hook = True
    # Layers with a window (Mistral, Qwen2's upper layers) attend within it and declare it
    # (kv_cache_specs), so the loader leaves max_model_len uncapped.
    applies_sliding_window = True

    def __init__(self, hf_config, ctx: ModelContext, prefix: str = "model") -> None:
        super().__init__(hf_config, ctx)
        config = hf_config
        if len(getattr(config, "layer_types", None) or ()) and \
                not set(config.layer_types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer types {sorted(set(config.layer_types))} are not supported "
                             "(only full_attention and sliding_attention)")
        self.model = self.build_model(config, prefix, ctx)
        # Layers with a sliding window (the config's sliding_window, for the layers its
        # layer_types / Qwen2's max_window_layers slide): each attends within it and keeps
        # the window's KV only (its KV-cache spec), so long contexts need no cap.
        self._kv_specs: list[KVCacheSpec] | None = None
        if getattr(config, "sliding_window", None):
            start, end = self.model.start_layer, self.model.end_layer
            self._kv_specs = llama_kv_specs(config, ctx.tp.size)[start:end]
            for i, spec in enumerate(self._kv_specs):
                if isinstance(spec, SlidingWindowSpec):
                    self.model.layers[start + i].self_attn.sliding_window = spec.sliding_window
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not ctx.pp.is_last_rank:  # only the last pipeline stage computes logits
            self.lm_head = PPMissingLayer()
        else:
            self.lm_head = Linear.build("lm_head", config.hidden_size, config.vocab_size,
                                        bias=False, dtype=ctx.dtype,
                                        linear_method=ctx.linear_method, parallel="column",
                                        gather_output=True)
        if self.tie_word_embeddings and ctx.pp.is_last_rank:
            # the head's method computes with the embedding matrix
            self.lm_head.weight = self.model.embed_tokens.weight
            # (a quantized method multiplies with the embedding's packed rows instead)
            self.lm_head.method.tied_embedding = self.model.embed_tokens
        # this stage's layers: the KV cache holds these only
        self.num_layers = self.model.end_layer - self.model.start_layer
        first = self.model.layers[self.model.start_layer]
        self.num_heads = first.self_attn.num_heads
        self.num_kv_heads = first.self_attn.num_kv_heads
        self.head_dim = _head_dim(config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Full attention per layer, or the config's sliding windows where layers slide."""
        if self._kv_specs is not None:
            return list(self._kv_specs)
        return super().kv_cache_specs()

    def build_model(self, config, prefix: str, ctx: ModelContext) -> nn.Module:
        """The decoder stack (``self.model``); a family with other layers (DeepSeek's MLA)
        builds its own and keeps this class's head, loading and facts."""
        return LlamaModel(config, prefix, ctx, self.make_mlp)

    def make_mlp(self, config, prefix: str, ctx: ModelContext,
                 layer_index: int) -> nn.Module | None:
        """Layer ``layer_index``'s MLP; ``None``: the gated MLP (subclasses put MoE blocks
        here)."""
        return None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states, or (a pipeline stage before the last) the tensors the
        next stage continues from."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds,
                          intermediate_tensors)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        embeddings = {f"{name}.weight": m for name, m in self.named_modules()
                      if isinstance(m, VocabEmbedding)}
        if self.tie_word_embeddings:
            linears.pop("lm_head", None)
        experts = tuple(f"{name}." for name, m in self.named_modules() if isinstance(m, FusedMoE))
        params = {name: p for name, p in self.named_parameters()
                  if name.rpartition(".")[0] not in linears and name != "lm_head.weight"
                  and not name.startswith(experts)}  # experts: the MoE model's loader
        expected = expected_linear_weights(linears) | {(name, None) for name in params}
        loaded = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_WEIGHTS) or is_pp_missing(self, name):
                continue  # (another pipeline stage's weights)
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # a tied checkpoint that also stores the output matrix
            key = load_linear_weight(linears, name, tensor)
            if key is not None:
                loaded.add(key)
                continue
            if name in embeddings:  # may be kept quantized (GGUF blocks)
                embeddings[name].load_weight(tensor, name)
                loaded.add((name, None))
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no counterpart in the model")
            loader = getattr(param, "weight_loader", None)  # a sharded parameter
            if loader is not None:
                loader(param, tensor)
            else:
                copy_weight(param, tensor, name)
            loaded.add((name, None))
        raise_if_missing(expected, loaded)
