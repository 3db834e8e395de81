"""Verifying draft tokens (speculative decoding) so that the output distribution is the
target's.

Each request brings K draft tokens and 1 + K logits rows (the target model's distribution at
each draft position, plus one past the last draft). Walking the drafts in order:

- greedy rows accept a draft while it equals the target's argmax; the first mismatch takes the
  argmax instead, and when all K are accepted the last row's argmax is a bonus token;
- sampled rows use the speculative-sampling rule (Leviathan et al., Chen et al.): accept draft x
  with probability min(1, p(x) / q(x)), else sample from norm(max(0, p - q)). Drafts given as
  tokens are a one-hot proposal q, so: accept with probability p(x), else sample from p with x
  removed; a draft model that drew its drafts from a distribution q passes q
  (``draft_probs``). The bonus row samples from p. The tokens returned are distributed exactly
  as the target's own samples would be.

``p`` is the row's distribution after every logits processor, penalty, temperature and
top-k / top-p / min-p filter: the distribution a non-speculative step would sample from.
"""
from __future__ import annotations

from typing import Callable

import torch

from llmkit.sampling.argmax import argmax_rows
from llmkit.sampling.params import is_random


def verify_drafts(logits: torch.Tensor, temperature: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_logits: list[int], generators: dict[int, torch.Generator],
                  filtered_probs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  default_generator: torch.Generator,
                  draft_probs: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, list[list[int]]]:
    """``(chosen [R], tokens per request)``: ``chosen[r]`` is the token logits row ``r``
    stands for in the output (the accepted draft, the replacement, or the bonus; rows after a
    rejection keep a sample nobody reads) and ``tokens[i]`` request i's accepted drafts plus
    one token. ``filtered_probs(logits_rows, row_index)`` gives the rows' sampling
    distribution. ``draft_probs [R, V]`` (optional) is q per logits row: the distribution the
    row's draft was drawn from (one-hot for a draft given as a token, zero on bonus rows);
    ``None`` means every draft is one-hot."""
    drafts = draft_token_ids
    chosen = argmax_rows(logits)
    accepted = chosen == drafts
    random_rows = is_random(temperature)
    if bool(random_rows.any()):
        idx = random_rows.nonzero().squeeze(1)
        probs = filtered_probs(logits[idx], idx)
        d = drafts[idx]
        has_draft = d >= 0
        pos = {int(r): i for i, r in enumerate(idx.tolist())}
        gens = {pos[r]: g for r, g in generators.items() if r in pos}
        # A seeded row draws its acceptance uniform only when it has a draft, so that a row
        # without one consumes its generator as a plain sampling step does.
        u = _uniform((len(idx),), {i: g for i, g in gens.items() if bool(has_draft[i])},
                     default_generator, probs.device)
        safe_d = d.clamp(min=0).unsqueeze(1)
        p_draft = probs.gather(1, safe_d).squeeze(1)
        if draft_probs is None:
            accepted[idx] = has_draft & accept(u, p_draft, torch.ones_like(p_draft))
            # A rejected draft's replacement comes from p without it; the bonus row from p.
            residual = probs.clone()
            rows = has_draft.nonzero().squeeze(1)
            residual[rows, d[rows]] = 0.0
        else:
            q = draft_probs[idx].to(probs.dtype)
            q_draft = q.gather(1, safe_d).squeeze(1)
            accepted[idx] = has_draft & accept(u, p_draft, q_draft)
            residual = (probs - q).clamp_(min=0.0)  # bonus rows: q = 0, so p itself
            # p <= q everywhere means a rejection had probability 0; rounding can still get
            # here: then p is the right distribution to draw from
            empty = residual.sum(dim=1) <= 0
            if bool(empty.any()):
                residual[empty] = probs[empty]
        noise = _uniform(residual.shape, gens, default_generator, probs.device)
        chosen[idx] = argmax_rows(residual.div_(noise.log_().neg_()))
    accepted_list, chosen_list, drafts_list = (accepted.tolist(), chosen.tolist(),
                                               drafts.tolist())
    outputs: list[list[int]] = []
    start = 0
    for n in num_logits:
        a = 0
        while a < n - 1 and accepted_list[start + a]:
            a += 1
        outputs.append(drafts_list[start:start + a] + [chosen_list[start + a]])
        for j in range(a):
            chosen_list[start + j] = drafts_list[start + j]
        start += n
    return torch.tensor(chosen_list, dtype=torch.int64, device=logits.device), outputs


def accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """The speculative-sampling acceptance test: ``u < min(1, p(x) / q(x))`` with ``u ~
    U[0, 1)``, written without the division (q(x) > 0 for a draft drawn from q)."""
    return u * q_draft < p_draft


def _uniform(shape: tuple[int, ...] | torch.Size, generators: dict[int, torch.Generator],
             default: torch.Generator, device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; a seeded row draws from its own generator (its tokens then do not
    depend on its batch)."""
    u = torch.empty(shape, device=device)
    if len(generators) < shape[0]:
        u.uniform_(generator=default)
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)
    return u
