"""Speculative decoding: proposers (``base.py``) and, in ``llmkit/sampling/rejection.py``, the
verification that keeps the target's distribution."""
from llmkit.spec_decode.base import Proposer

__all__ = ["Proposer"]
