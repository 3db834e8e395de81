"""Mamba-2's recurrent ops over a flat batch of requests (seed ch. 09: a state per request, not
per token): the causal depthwise conv1d with a carried conv state, and the selective-state
(SSD) scan with a carried SSM state. The torch reference, written against transformers'
``modeling_bamba`` torch path (``causal_conv1d_fn`` / ``causal_conv1d_update`` and
``mamba2_chunk_scan`` / ``mamba2_selective_state_update``).

Shapes: tokens ``[T, ...]`` of every request concatenated (``RecurrentBatch.query_start_loc``
cuts them); ``conv_state [num_blocks, conv_dim, d_conv - 1]`` and ``ssm_state [num_blocks,
n_heads, head_dim, d_state]`` hold one request's state per block, request r's at block
``state_indices[r]``. A request whose step starts with no computed tokens (its first step, or
its recompute after preemption) starts from zeros; any other continues from its block, so a
prompt cut into chunks gives the state and outputs of the whole prompt in one piece.

A one-token row (a decode) is the special case: its state is updated in place by one step of
the recurrence (``conv1d_update`` / ``ssm_state_update``, batched over every such row); longer
rows run the chunked SSD form per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class RecurrentBatch:
    """One step's requests as a recurrent layer sees them (built once per step and group).

    ``query_start_loc`` (host): request r's tokens are rows ``[qsl[r], qsl[r+1])``;
    ``state_indices`` (int64 ``[R]``): the block of request r's state; ``has_initial_state``
    (host): False where the request had no computed tokens when its step began (zero state)."""

    query_start_loc: list[int]
    state_indices: torch.Tensor
    has_initial_state: list[bool]
    #: requests with one token this step, and the rest (derived)
    decode_rows: list[int] = field(init=False)
    prefill_rows: list[int] = field(init=False)
    #: the decode rows' token indices and state blocks (int64 tensors)
    decode_tokens: torch.Tensor = field(init=False)
    decode_states: torch.Tensor = field(init=False)
    #: the state blocks to zero before the step (requests starting from nothing)
    fresh_states: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        qsl = self.query_start_loc
        n = len(qsl) - 1
        decode = [r for r in range(n) if qsl[r + 1] - qsl[r] == 1]
        prefill = [r for r in range(n) if qsl[r + 1] - qsl[r] > 1]
        idx = self.state_indices.long()
        dev = idx.device
        object.__setattr__(self, "state_indices", idx)
        object.__setattr__(self, "decode_rows", decode)
        object.__setattr__(self, "prefill_rows", prefill)
        object.__setattr__(self, "decode_tokens",
                           torch.tensor([qsl[r] for r in decode], dtype=torch.long, device=dev))
        object.__setattr__(self, "decode_states", idx[decode] if decode else idx[:0])
        fresh = [r for r in range(n) if not self.has_initial_state[r]]
        object.__setattr__(self, "fresh_states", idx[fresh] if fresh else idx[:0])

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc) - 1


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"conv1d activation {activation!r} is not supported (silu or none)")


def zero_fresh_states(state: torch.Tensor, batch: RecurrentBatch) -> None:
    """Requests that start from nothing this step start from a zero state (their block may
    hold a finished request's state)."""
    if batch.fresh_states.numel():
        state.index_fill_(0, batch.fresh_states, 0)


# -- causal depthwise conv1d ---------------------------------------------------------------
def _depthwise(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               length: int) -> torch.Tensor:
    """``window [..., C, K - 1 + length]`` -> ``[..., C, length]``: output t is
    ``sum_k weight[:, k] * window[..., t + k] (+ bias)``, as K shifted multiply-adds in float32
    (what ``F.conv1d`` computes; its oneDNN call costs more than the math at these sizes)."""
    window = window.float()
    w = weight.float()
    out = window[..., :length] * w[:, :1]
    for k in range(1, w.shape[1]):
        out = out + window[..., k:k + length] * w[:, k:k + 1]
    return out if bias is None else out + bias.float()[:, None]


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """One token per row: ``x [R, C]`` -> ``[R, C]``; row r's window is its ``d_conv - 1``
    previous inputs (``conv_state[state_indices[r]]``, shifted by one in place) and itself."""
    window = torch.cat([conv_state[state_indices], x.unsqueeze(-1).to(conv_state.dtype)], -1)
    conv_state[state_indices] = window[:, :, 1:]
    out = _depthwise(window, weight, bias, 1)[:, :, 0]
    return _activate(out, activation).to(x.dtype)


def causal_conv1d_chunk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        state: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """One request's chunk: ``x [L, C]`` after the inputs ``state [C, d_conv - 1]`` holds;
    ``state`` becomes the last ``d_conv - 1`` inputs."""
    k1 = state.shape[-1]
    full = torch.cat([state, x.t().to(state.dtype)], -1)  # [C, k1 + L]
    state.copy_(full[:, full.shape[1] - k1:])
    out = _depthwise(full, weight, bias, x.shape[0])
    return _activate(out, activation).t().to(x.dtype)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            conv_state: torch.Tensor, batch: RecurrentBatch,
                            activation: str | None = "silu") -> torch.Tensor:
    """``x [T, C]`` (every request's tokens) -> ``[T, C]``, each request's conv over its carried
    inputs then this step's; ``weight [C, d_conv]``."""
    zero_fresh_states(conv_state, batch)
    out = torch.empty_like(x)
    if batch.decode_rows:
        out[batch.decode_tokens] = causal_conv1d_update(
            x[batch.decode_tokens], weight, bias, conv_state, batch.decode_states, activation)
    qsl = batch.query_start_loc
    for r in batch.prefill_rows:
        state = conv_state[int(batch.state_indices[r])]  # a view: updated in place
        out[qsl[r]:qsl[r + 1]] = causal_conv1d_chunk(x[qsl[r]:qsl[r + 1]], weight, bias, state,
                                                     activation)
    return out


# -- the selective-state scan ----------------------------------------------------------------
def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  dt_limit: tuple[float, float]) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in float32 (transformers clamps in the chunk
    form only; with the default limits ``(0, inf)`` the clamp changes nothing)."""
    dt = F.softplus(dt.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., l] -> [..., l, l]``: entry ``(i, j)`` is ``sum(x[j+1 .. i])`` for ``j <= i``,
    ``-inf`` above the diagonal (transformers' stable masked-cumsum form)."""
    n = x.shape[-1]
    x = x[..., None].expand(*x.shape, n)
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~lower, 0)
    s = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0)
    return s.masked_fill(~keep, -torch.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, chunk_size: int,
                   initial_state: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in SSD's chunked form: ``x [L, H, P]``, ``dt [L, H]`` (discretized),
    ``A [H]`` (negative), ``B, C [L, H, N]`` (per head) and ``initial_state [H, P, N]`` ->
    ``(y [L, H, P] without the D skip, final_state [H, P, N])``, float32. Within a chunk of
    ``chunk_size`` tokens the output is a masked quadratic form; chunk boundaries carry the
    state (transformers' ``mamba2_chunk_scan`` for one sequence)."""
    length, h, p = x.shape
    n = B.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    x = x.float() * dt[..., None]
    a = A.float()[None, :] * dt  # [L, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    x, a, B, C = chunks(x), chunks(a), chunks(B.float()), chunks(C.float())
    a = a.permute(2, 0, 1)  # [H, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)
    # 1. within each chunk: the causal quadratic form
    decay = torch.exp(_segment_sum(a))  # [H, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    # 2. each chunk's own contribution to the state at its end
    decay_states = torch.exp(a_cumsum[:, :, -1:] - a_cumsum)  # [H, c, l]
    b_decay = B * decay_states.permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", b_decay, x)
    # 3. the recurrence over chunk boundaries, from the carried state
    if initial_state is None:
        initial_state = torch.zeros(h, p, n, dtype=torch.float32, device=x.device)
    states = torch.cat([initial_state.float()[None], states], dim=0)  # [c + 1, H, P, N]
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, -1], (1, 0))))  # [H, c+1, c+1]
    new_states = torch.einsum("zch,zhpn->chpn", decay_chunk.permute(2, 1, 0), states)
    states, final_state = new_states[:-1], new_states[-1]
    # 4. each chunk's start state read out by C
    y_off = torch.einsum("clhn,chpn->clhp", C, states) * \
        torch.exp(a_cumsum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, h, p)[:length]
    return y, final_state


def ssm_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                     ssm_state: torch.Tensor, state_indices: torch.Tensor,
                     dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """One token per row (decode): ``x [R, H, P]``, ``dt [R, H]`` (raw), ``B, C [R, G, N]`` ->
    ``y [R, H, P]`` float32 with the D skip; ``ssm_state[state_indices]`` becomes
    ``state * exp(dt A) + dt B x``."""
    r, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    dt = discretize_dt(dt, dt_bias, dt_limit)  # [R, H]
    da = torch.exp(dt * A.float()[None, :])
    bh = B.float().repeat_interleave(h // g, dim=1)  # [R, H, N]
    ch = C.float().repeat_interleave(h // g, dim=1)
    xf = x.float()
    state = ssm_state[state_indices].float()  # [R, H, P, N]
    dbx = (dt[:, :, None, None] * bh[:, :, None, :]) * xf[..., None]
    state = state * da[:, :, None, None] + dbx
    ssm_state[state_indices] = state.to(ssm_state.dtype)
    y = torch.bmm(state.view(r * h, p, n), ch.reshape(r * h, n, 1)).view(r, h, p)
    return y + xf * D.float()[None, :, None]


def ssd_scan_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                       ssm_state: torch.Tensor, batch: RecurrentBatch, chunk_size: int,
                       dt_limit: tuple[float, float] = (0.0, float("inf")),
                       update: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Every request's scan: ``x [T, H, P]``, ``dt [T, H]`` (raw: ``dt_bias`` and softplus are
    applied here), ``A [H]`` (negative), ``B, C [T, G, N]``, ``D [H]`` -> ``y [T, H, P]``
    float32 (with the D skip); each request's state continues from its block and is left
    there. ``update``: the decode rows' op (a platform's :func:`ssm_state_update`)."""
    zero_fresh_states(ssm_state, batch)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if batch.decode_rows:
        t = batch.decode_tokens
        y[t] = (update or ssm_state_update)(x[t], dt[t], A, B[t], C[t], D, dt_bias, ssm_state,
                                batch.decode_states, dt_limit)
    h, g = x.shape[1], B.shape[1]
    qsl = batch.query_start_loc
    for r in batch.prefill_rows:
        a, b = qsl[r], qsl[r + 1]
        block = int(batch.state_indices[r])
        xs = x[a:b].float()
        out, final = ssd_chunk_scan(
            xs, discretize_dt(dt[a:b], dt_bias, dt_limit), A,
            B[a:b].float().repeat_interleave(h // g, dim=1),
            C[a:b].float().repeat_interleave(h // g, dim=1), chunk_size,
            ssm_state[block])
        ssm_state[block] = final.to(ssm_state.dtype)
        y[a:b] = out + xs * D.float()[None, :, None]
    return y
