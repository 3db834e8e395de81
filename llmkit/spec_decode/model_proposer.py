"""What a proposer that runs a model does each step (draft model, EAGLE head).

After the target's step, per scheduled row (``c`` = tokens computed before the step, ``v`` = the
step's positions whose target KV is kept: a prefill chunk, or the next token plus the accepted
drafts):

1. **catch-up pass** over every scheduled row: the draft computes its own KV for the same
   positions the target kept (a sampling row also feeds its new token), so the draft's KV
   always covers every known token — in the same blocks as the target's, so preemption,
   prefix caching and freeing cover it too. Rows that sampled take their first draft from the
   last position's logits;
2. **K - 1 decode passes** over the drafting rows, one draft token each (dependencies inside a
   draft stay serial).

Draft positions write KV into the slots the scheduler reserved (``num_lookahead_tokens`` = K);
those past the accepted tokens are garbage until the next step's catch-up pass overwrites the
positions that became known. Drafts never reach past ``max_model_len`` or a row's blocks.
"""
from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from llmkit.spec_decode.base import (Proposer, ProposerBatch, ProposerEnv, StepContext,
                                     num_valid_tokens)
from llmkit.spec_decode.draft_inputs import DraftInputs, build_draft_inputs
from llmkit.spec_decode.draft_sampling import draw_drafts


class ModelProposer(Proposer):
    #: The draft's input at position p is the token at p + token_offset (EAGLE: 1).
    token_offset: int = 0

    def __init__(self, num_speculative_tokens: int, env: ProposerEnv) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.env = env
        self.device = env.device
        self.block_size = env.block_size
        self.max_model_len = env.max_model_len
        self.kv_caches: list[torch.Tensor] = []
        # unseeded rows' draft draws (seeded rows use their own generator)
        self._generator = torch.Generator(env.device).manual_seed(env.seed + 1)
        # the last proposal's q per sampled request: (drafts, q [len, V])
        self._q: dict[str, tuple[list[int], torch.Tensor]] = {}

    # -- what a subclass supplies ------------------------------------------------------------
    @abstractmethod
    def _catch_up_inputs(self, batch: ProposerBatch, step: StepContext
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor | None]:
        """``(index, starts, counts, hidden)`` of the catch-up pass: ``index`` selects the
        scheduled rows (of ``step.rows``) that take part, ``hidden`` is the extra input per
        token (EAGLE: the target's hidden states), or None."""

    @abstractmethod
    def _forward(self, inputs: DraftInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        """The draft's output hidden states ``[T, H]``; ``hidden`` is the extra input per
        token: the catch-up's (``_catch_up_inputs``), then each decode pass's previous output
        state of its rows (a draft model ignores it)."""

    @abstractmethod
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of output hidden rows."""

    #: How many positions before a row's token count the catch-up pass's last position lies
    #: (draft model: the new token's, 1; EAGLE: the one before it, 2).
    _last_offset: int = 1

    # -- the step ----------------------------------------------------------------------------
    def propose(self, batch: ProposerBatch, rows: np.ndarray,
                step: StepContext | None = None) -> dict[str, list[int]]:
        if step is None:
            raise ValueError(f"{type(self).__name__} needs the step's context")
        self._q = {}
        k = self.num_drafts(len(rows), batch.num_reqs)
        index, starts, counts, hidden = self._catch_up_inputs(batch, step)
        if not len(index):
            return {}
        crow = step.rows[index]
        inputs = build_draft_inputs(batch, crow, starts, counts, self.block_size,
                                    self.env.ctx.attn_backend, self.device, self.token_offset)
        out = self._forward(inputs, hidden)
        num_tokens = batch.num_tokens[crow]
        # Draft j (0-based) is computed at position num_tokens - _last_offset + j: within the
        # row's blocks and short of max_model_len.
        slots = batch.num_blocks[crow] * self.block_size
        room = np.minimum.reduce([np.full(len(crow), k), self.max_model_len - num_tokens,
                                  slots - num_tokens + self._last_offset])
        drafting = np.flatnonzero(step.samples[index] & (room > 0))
        if not len(drafting):
            return {}
        drows = crow[drafting]
        room = room[drafting]
        last = torch.from_numpy(inputs.last[drafting]).to(self.device)
        state = out[last]
        tokens, q, sampled = draw_drafts(self._logits(state), batch, drows, self._generator)
        drafts = np.zeros((len(drows), int(room.max())), dtype=np.int64)
        drafts[:, 0] = tokens
        q_steps: list[tuple[np.ndarray, torch.Tensor]] = []
        if q is not None:
            q_steps.append((sampled, q))
        base = batch.num_tokens[drows]
        state_rows = np.arange(len(drows))  # which drafting rows ``state`` holds
        for j in range(1, int(room.max())):
            active = np.flatnonzero(room > j)
            arows = drows[active]
            # the previous draft is this pass's input token
            batch.token_ids[arows, base[active] - 1 + j] = drafts[active, j - 1]
            positions = base[active] - self._last_offset + j
            inputs = build_draft_inputs(batch, arows, positions, np.ones(len(arows), np.int64),
                                        self.block_size, self.env.ctx.attn_backend,
                                        self.device, self.token_offset)
            # the previous pass's output states (EAGLE feeds them to the next pass)
            prev = state[torch.from_numpy(np.searchsorted(state_rows, active)).to(self.device)]
            state = self._forward(inputs, prev)
            state_rows = active
            tokens, q, sampled = draw_drafts(self._logits(state), batch, arows,
                                             self._generator)
            drafts[active, j] = tokens
            if q is not None:
                q_steps.append((active[sampled], q))
        out_drafts: dict[str, list[int]] = {}
        req_ids = batch.req_ids
        for i, row in enumerate(drows.tolist()):
            out_drafts[req_ids[row]] = drafts[i, :int(room[i])].tolist()
        if q_steps:
            self._keep_q(out_drafts, drows, q_steps, batch)
        return out_drafts

    def _keep_q(self, out_drafts: dict[str, list[int]], drows: np.ndarray,
                q_steps: list[tuple[np.ndarray, torch.Tensor]], batch: ProposerBatch) -> None:
        per_row: dict[int, list[torch.Tensor]] = {}
        for which, q in q_steps:  # in draft order: step j's rows are a subset of step j-1's
            for pos, i in enumerate(which.tolist()):
                per_row.setdefault(i, []).append(q[pos])
        for i, qs in per_row.items():
            rid = batch.req_ids[int(drows[i])]
            self._q[rid] = (out_drafts[rid], torch.stack(qs))

    def draft_probs(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        entry = self._q.get(req_id)
        if entry is None:
            return None
        proposed, q = entry
        if proposed[:len(drafts)] != list(drafts):
            raise RuntimeError(f"request {req_id!r}: the drafts to verify {drafts} are not the "
                               f"ones proposed {proposed}")
        return q[:len(drafts)]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches


def catch_up_ranges(batch: ProposerBatch, step: StepContext, include_new_token: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every scheduled row, from its first position this step over the positions whose
    target KV is kept (plus the new token of a sampling row when ``include_new_token``), never
    reaching ``max_model_len`` (``batch.token_ids``' width)."""
    valid = num_valid_tokens(batch, step)
    counts = valid + (step.samples.astype(np.int64) if include_new_token else 0)
    counts = np.minimum(counts, batch.max_model_len - step.computed)
    index = np.flatnonzero(counts > 0)
    return index, step.computed[index], counts[index]
