"""EAGLE drafts: a one-layer head over the target's hidden states and token embeddings, sharing
the target's LM head (``llmkit/models/llama_eagle.py``), K cheap steps a step.

The head's input at position p is the target's feature there and the token at p + 1, so its
catch-up pass covers the positions whose next token is known (the kept positions of the step,
the new token being the last one's next) and its first draft comes from the last of them; each
further pass feeds the head's own predicted feature back. Its KV lives in the target's blocks.
Because the head's KV at a position depends on the next token, a prefix-cache hit leaves its
last block to be recomputed (the scheduler's ``drop_last_cached_block``, vLLM's rule): only a
matching next block guarantees that token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from llmkit.config.errors import ConfigError
from llmkit.models.llama_eagle import EagleLlamaHead
from llmkit.spec_decode.base import ProposerBatch, ProposerEnv, StepContext
from llmkit.spec_decode.draft_inputs import DraftInputs
from llmkit.spec_decode.model_proposer import ModelProposer, catch_up_ranges

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _iter_head_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if (folder / "model.safetensors").is_file():
        from llmkit.models.loader.safetensors import iter_safetensors_weights
        yield from iter_safetensors_weights(folder)
        return
    state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    yield from state.items()


def _weight_names(folder: Path) -> set[str]:
    if (folder / "model.safetensors").is_file():
        from safetensors import safe_open
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return set(f.keys())
    return set(torch.load(folder / "pytorch_model.bin", map_location="cpu",
                          weights_only=True))


def load_eagle_head(path: str, env: ProposerEnv) -> EagleLlamaHead:
    """The head in folder ``path``; ConfigError (``speculative.model``) when it is no EAGLE
    folder or does not fit the target."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file() or not any((folder / f).is_file()
                                                        for f in WEIGHT_FILES):
        raise ConfigError("speculative.model", path, "an EAGLE head's folder (config.json and "
                          "model.safetensors or pytorch_model.bin)")
    config = AutoConfig.from_pretrained(str(folder))
    if config.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ConfigError("speculative.model", path, "", message=(
            f"EAGLE heads of the Llama family are supported; this one is "
            f"{config.model_type!r}"))
    if getattr(config, "add_para_norm", False) or \
            json.loads((folder / "config.json").read_text()).get("draft_vocab_size"):
        raise ConfigError("speculative.model", path, "", message=(
            "this head is an EAGLE variant (HASS norms / EAGLE-3 draft vocabulary) that is not "
            "supported; EAGLE-1 heads are"))
    target = env.target
    if config.hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
        raise ConfigError("speculative.model", path, "", message=(
            f"the head (hidden {config.hidden_size}, vocabulary {config.vocab_size}) does not "
            f"fit the target (hidden {target.hidden_size}, vocabulary {target.vocab_size})"))
    if config.max_position_embeddings < env.max_model_len:
        raise ConfigError("speculative.model", path, "", message=(
            f"the head handles {config.max_position_embeddings} positions, fewer than "
            f"model.max_model_len ({env.max_model_len})"))
    fc_bias = "fc.bias" in _weight_names(folder)
    with torch.device(env.device):
        head = EagleLlamaHead(config, env.ctx, fc_bias=fc_bias)
    try:
        head.load_weights(_iter_head_weights(folder))
    except ValueError as e:
        raise ConfigError("speculative.model", path, "", message=str(e)) from None
    return head.eval()


class EagleProposer(ModelProposer):
    token_offset = 1
    _last_offset = 2

    def __init__(self, head: EagleLlamaHead, num_speculative_tokens: int,
                 env: ProposerEnv) -> None:
        super().__init__(num_speculative_tokens, env)
        self.head = head
        self.target = env.target

    @classmethod
    def from_config(cls, config, env: ProposerEnv) -> "EagleProposer":
        return cls(load_eagle_head(config.model, env), config.num_speculative_tokens, env)

    def kv_cache_layers(self) -> list[tuple[int, int]]:
        return [(self.head.num_kv_heads, self.head.head_dim)] * self.head.num_layers

    def _catch_up_inputs(self, batch: ProposerBatch, step: StepContext
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor | None]:
        index, starts, counts = catch_up_ranges(batch, step, include_new_token=False)
        if not len(index):
            return index, starts, counts, None
        first = np.cumsum(counts) - counts
        rows = (np.repeat(step.query_starts[index], counts)
                + np.arange(int(counts.sum())) - np.repeat(first, counts))
        hidden = step.hidden_states[torch.from_numpy(rows).to(step.hidden_states.device)]
        return index, starts, counts, hidden

    def _forward(self, inputs: DraftInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        embeds = self.target.embed_input_ids(inputs.input_ids)
        return self.head(embeds, inputs.positions, hidden, self.kv_caches, inputs.metadata)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
