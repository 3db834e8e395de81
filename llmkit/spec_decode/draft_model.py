"""A draft model: a smaller model with the target's tokenizer drafts K tokens in K cheap steps.

It is built like the target (``build_model`` with the same ``ModelContext``: dtype, attention
backend, platform ops, linear methods) and keeps its KV in the target's blocks, layers of its
own (``kv_cache_layers``): the KV budget per block counts them, and preemption, prefix caching
and freeing cover them with the target's. Its vocabulary must be the target's (checked at
start-up: a mismatch is a config error naming ``speculative.model``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmkit.config.errors import ConfigError
from llmkit.models.base import CausalLM
from llmkit.spec_decode.base import ProposerBatch, ProposerEnv, StepContext
from llmkit.spec_decode.draft_inputs import DraftInputs
from llmkit.spec_decode.model_proposer import ModelProposer, catch_up_ranges


def resolve_draft_source(spec_model: str, max_model_len: int):
    """``speculative.model`` as a ``ModelSource``: a preset name (``conf/model/NAME.yaml``),
    an HF folder or a .gguf file."""
    from llmkit.config.compose import conf_dir, model_presets
    from llmkit.config.schema import ModelConfig
    from llmkit.models.loader import resolve_model_source

    if spec_model in model_presets():
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{spec_model}.yaml"))
        cfg = ModelConfig(**{k: v for k, v in data.items() if k in ModelConfig.model_fields})
    else:
        path = Path(spec_model).expanduser()
        if not path.exists():
            raise ConfigError("speculative.model", spec_model,
                              "a model preset, an HF model folder or a .gguf file that exists")
        cfg = ModelConfig(path=str(path.resolve()))
    cfg = cfg.model_copy(update={"max_model_len": None})
    try:
        source = resolve_model_source(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError("speculative.model", spec_model, "", message=str(e)) from None
    if source.max_model_len < max_model_len:
        raise ConfigError("speculative.model", spec_model, "", message=(
            f"the draft model handles {source.max_model_len} positions, fewer than the "
            f"target's max_model_len ({max_model_len}); lower model.max_model_len"))
    return source


def check_vocab(draft_vocab: int, target_vocab: int, spec_model: str) -> None:
    if draft_vocab != target_vocab:
        raise ConfigError("speculative.model", spec_model, "", message=(
            f"the draft's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: "
            "a draft model must share the target's tokenizer"))


class DraftModelProposer(ModelProposer):
    token_offset = 0
    _last_offset = 1

    def __init__(self, model: CausalLM, num_speculative_tokens: int, env: ProposerEnv) -> None:
        super().__init__(num_speculative_tokens, env)
        check_vocab(model.vocab_size, env.target.vocab_size, "<draft model>")
        self.model = model

    @classmethod
    def from_config(cls, config, env: ProposerEnv) -> "DraftModelProposer":
        from llmkit.models.loader import build_model

        source = resolve_draft_source(config.model, env.max_model_len)
        check_vocab(source.hf_config.vocab_size, env.target.vocab_size, config.model)
        return cls(build_model(source, env.ctx, env.device), config.num_speculative_tokens,
                   env)

    def kv_cache_layers(self) -> list[tuple[int, int]]:
        m = self.model
        return [(m.num_kv_heads, m.head_dim)] * m.num_layers

    def _catch_up_inputs(self, batch: ProposerBatch, step: StepContext
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor | None]:
        index, starts, counts = catch_up_ranges(batch, step, include_new_token=True)
        return index, starts, counts, None

    def _forward(self, inputs: DraftInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
