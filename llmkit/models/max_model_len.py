"""``max_model_len``: the context length an engine (or the simulator) runs a model with — the
length asked for in the config, checked against what the model supports, else the model's own
limit. Shared by the real model loader and ``llmkit sim``, which must agree on it."""
from __future__ import annotations

__all__ = ["cap_max_model_len"]


def cap_max_model_len(limit: int | None, requested: int | None, *, key: str,
                      model: str = "the model", error: type[ValueError] = ValueError) -> int:
    """``requested`` (the value of config key ``key``), else ``limit`` (the most the model
    supports, e.g. its ``max_position_embeddings``). Raises ``error`` naming ``model`` when
    neither is known or ``requested`` is more than ``limit``."""
    if limit is None:
        if requested is None:
            raise error(f"{model}'s config has no max_position_embeddings; set {key}")
        return requested
    if requested is None:
        return int(limit)
    if requested > limit:
        raise error(f"{key}={requested} is more than {model} supports ({limit}, from its "
                    f"config); use a value <= {limit}")
    return requested
