"""The ``speculative`` section: speculative decoding."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from llmkit.config.sections.strict import _Component

__all__ = ["SpeculativeConfig"]


class SpeculativeConfig(_Component):
    """Speculative decoding (group ``speculative``; vLLM's keys where vLLM has them): a
    proposer drafts up to ``num_speculative_tokens`` tokens per decoding request and step, the
    target verifies them in one forward (``llmkit/spec_decode/``)."""

    # none | ngram | draft_model | eagle, or a registered proposer / a _target_ class path
    name: str = "none"
    # K: the most draft tokens per request and step
    num_speculative_tokens: int = Field(default=0, ge=0)
    # ngram (prompt lookup): the suffix lengths tried, longest first
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=5, ge=1)
    # draft_model: a smaller model with the target's vocabulary (a preset, an HF folder or a
    # .gguf); eagle: an EAGLE head's folder (config.json + weights)
    model: str | None = None
    # K shrinks as more rows are drafted, to 0 where rows x (1 + K) passes the ridge point
    adaptive: bool = False
    # vLLM's: no drafts in a step whose batch has at least this many running requests
    disable_by_batch_size: int | None = Field(default=None, ge=1)
    # The tokens per forward where the model stops being memory-bound on this machine (what
    # `adaptive` compares against); null = the platform measures it at start-up (a short timing
    # of the model's forward at a few token counts). `llmkit sim` derives it from the profile.
    ridge_tokens: int | None = Field(default=None, ge=1)
    # `llmkit sim` only (no real engine reads it): the acceptance model, P(draft j accepted |
    # drafts before it accepted) for j = 0, 1, ...; the last value repeats past the list
    acceptance_rates: list[float] = Field(default_factory=lambda: [0.8, 0.7, 0.6, 0.5])

    @field_validator("acceptance_rates")
    @classmethod
    def _probabilities(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 <= x <= 1.0 for x in v):
            raise ValueError(f"must be a non-empty list of probabilities in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if not self.enabled:
            return self
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative.num_speculative_tokens must be >= 1 with "
                             f"speculative={self.target or self.name}, got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must "
                             f"be <= speculative.prompt_lookup_max ({self.prompt_lookup_max})")
        if self.name in ("draft_model", "eagle") and not self.model:
            raise ValueError(f"speculative.model is required with speculative={self.name} "
                             "(a path or preset of the draft model / EAGLE head)")
        return self

    @property
    def enabled(self) -> bool:
        return self.name != "none" or self.target is not None

    @property
    def runs_a_model(self) -> bool:
        """Draft model and EAGLE write KV of their own at the draft positions (lookahead);
        a ``_target_`` proposer may too."""
        return self.name in ("draft_model", "eagle") or self.target is not None
