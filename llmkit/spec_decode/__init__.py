"""Speculative decoding: proposers (``base.py``; ``ngram``, ``draft_model``, ``eagle``), picked by
``speculative.name`` (or ``speculative._target_``), and, in ``llmkit/sampling/rejection.py``, the
verification that keeps the target's distribution."""
from llmkit.registry import Registry
from llmkit.spec_decode.base import Proposer, ProposerBatch, ProposerEnv, StepContext

PROPOSERS: Registry = Registry("proposer")
PROPOSERS.register_lazy("ngram", "llmkit.spec_decode.ngram.NgramProposer")
PROPOSERS.register_lazy("draft_model", "llmkit.spec_decode.draft_model.DraftModelProposer")
PROPOSERS.register_lazy("eagle", "llmkit.spec_decode.eagle.EagleProposer")

__all__ = ["PROPOSERS", "Proposer", "ProposerBatch", "ProposerEnv", "StepContext", "build_proposer"]


def build_proposer(config, env: ProposerEnv) -> Proposer | None:
    """The proposer for ``config`` (a ``SpeculativeConfig``), or None for ``none``."""
    if not config.enabled and not config.target:
        return None
    cls = PROPOSERS.resolve(config.name, config.target)
    return cls.from_config(config, env)
