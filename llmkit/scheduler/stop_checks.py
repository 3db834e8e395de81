"""When a request stops: after each token it appends, the sampling parameters' stop conditions
and the length caps (``max_tokens``, ``max_model_len``)."""
from __future__ import annotations

from llmkit.request import Request, RequestStatus


def stop_status(req: Request, tok: int, max_model_len: int) -> RequestStatus | None:
    """The status ``req`` ends with now that ``tok`` was appended (None: it goes on); a stop
    token is recorded as its ``stop_reason``."""
    sp = req.sampling_params
    n_out = len(req.output_token_ids)
    if n_out >= sp.min_tokens:
        if tok == req.eos_token_id and not sp.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if tok in sp.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_tokens or len(req.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
