"""The packed token bitmask (xgrammar's layout) as dense masks: for checks, tests, and the
temporary bridge to the runner's per-request mask seam."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmkit.scheduler.base import SchedulerOutput

__all__ = ["legacy_token_masks", "unpack_bitmask"]


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool ``[rows, vocab_size]`` (True = allowed) of an int32 ``[rows, ceil(V / 32)]``
    bitmask whose bit ``i`` of word ``j`` allows token ``32 * j + i``."""
    words = np.ascontiguousarray(np.atleast_2d(bitmask), dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return bits.view(bool)  # unpackbits writes 0 / 1 bytes: already bools


def legacy_token_masks(so: SchedulerOutput, vocab_size: int) -> dict[str, np.ndarray]:
    """TEMPORARY (issue 19, until the issue-17 sampler applies ``so.grammar_bitmask`` itself):
    the step's bitmask as today's seam, ``SchedulerOutput.token_masks`` (request id -> dense
    bool mask), consumed by ``worker/sampling_inputs.py::_external_mask``. One row per request:
    there are no draft tokens yet."""
    if so.grammar_bitmask is None:
        return {}
    ids = so.structured_output_request_ids
    if len(ids) != len(so.grammar_bitmask):
        raise NotImplementedError("the dense-mask bridge handles one bitmask row per request; "
                                  "draft tokens need the sampler to apply grammar_bitmask")
    dense = unpack_bitmask(so.grammar_bitmask, vocab_size)
    return {rid: dense[i] for i, rid in enumerate(ids)}
