"""Truncation filters applied after temperature: min-p, then top-k, then top-p.

Each takes temperature-scaled float32 logits ``[B, V]`` and per-row parameters, and returns
logits with the removed tokens at -inf. Top-p acts on the distribution that min-p and top-k
left (renormalised), as in vLLM.
"""
from __future__ import annotations

import torch

from llmkit.config.cpu_dispatch import CpuDispatch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens with ``p < min_p * p_max`` (``min_p`` 0 removes nothing)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


# Top-p first looks for its cut among each row's most likely tokens: a full sort of a large
# vocabulary costs ~20x a top-256 on the CPU, and real distributions put their mass in the
# head. A fixed number (not one derived from the batch) keeps each row's result independent of
# the other rows. The CPU platform hands the sampler its dispatch table's value (the same
# number by default); this one serves callers without a table (CUDA, draft sampling).
TOP_P_CANDIDATES = CpuDispatch().top_p_candidates


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None,
                      candidates: int | None = None) -> torch.Tensor:
    """Keep each row's ``top_k`` most likely tokens (0 = all), then the smallest prefix of
    those, by descending probability, whose mass reaches ``top_p`` (the most likely token
    always stays). ``candidates``: how many tokens the cut is first looked for among
    (default ``TOP_P_CANDIDATES``)."""
    c = TOP_P_CANDIDATES if candidates is None else candidates
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k)
    vocab = logits.shape[-1]
    if vocab <= c:
        return _top_k_top_p_sorted(logits, top_k, top_p)
    k = _k_or_vocab(top_k, logits)
    off = (top_p >= 1.0) & (k >= vocab)  # nothing to filter in these rows
    values, ids = logits.topk(c, dim=-1)  # descending
    in_k = torch.arange(c, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
    values = values.masked_fill(~in_k, _NEG_INF)
    limited = k <= c  # top-k keeps only candidates: they are the whole distribution
    norm = torch.where(limited, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - norm.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=-1)
    # The cut lies among the candidates when top-k keeps no more than them, or when there is
    # no top-k (so ``norm`` is the whole row's) and the candidates' mass reaches top_p.
    fast = ~off & (limited | ((k >= vocab) & (cum[:, -1] >= top_p)))
    slow = ~off & ~fast
    outside = ((cum - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    outside[:, 0] = False
    kept = values.masked_fill(outside, _NEG_INF)
    out = torch.where(off.unsqueeze(1), logits, _NEG_INF)
    rows = fast.nonzero().squeeze(1)
    out[rows] = out[rows].scatter_(1, ids[rows], kept[rows])
    if bool(slow.any()):
        rows = slow.nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(logits[rows], None if top_k is None else top_k[rows],
                                        top_p[rows])
    return out


def _k_or_vocab(top_k: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    if top_k is None:
        return torch.full((logits.shape[0],), vocab, dtype=torch.int64, device=logits.device)
    return torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor) -> torch.Tensor:
    """The reference: sort the whole row."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        beyond_k = torch.arange(vocab, device=logits.device).unsqueeze(0) >= \
            _k_or_vocab(top_k, logits).unsqueeze(1)
        sorted_logits.masked_fill_(beyond_k, _NEG_INF)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rows with top_p = 1 keep everything: in float32 the mass before a far-tail token can
    # round up to 1.0, and dropping it would make such a row depend on its batch.
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    outside[:, 0] = False
    sorted_logits.masked_fill_(outside, _NEG_INF)
    return logits.scatter_(-1, order, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: ``topk`` to the batch's largest k, then a threshold per row
    (tokens tied with the k-th are kept, as in vLLM)."""
    vocab = logits.shape[-1]
    off = (top_k <= 0) | (top_k >= vocab)
    if bool(off.all()):
        return logits
    k = top_k.masked_fill(off, 1)
    top_values = logits.topk(int(k.max()), dim=-1).values  # descending
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))
    threshold.masked_fill_(off.unsqueeze(1), _NEG_INF)  # rows with top-k off keep everything
    return logits.masked_fill_(logits < threshold, _NEG_INF)
