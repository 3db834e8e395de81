"""Multi-LoRA's plain data: which adapter a request uses, an adapter's weights, and the step's
mapping from rows to slots.

- :class:`LoRARequest` (vLLM's name and fields): an adapter by name, a positive integer id (its
  identity: the id enters the KV block hashes) and a PEFT folder.
- :class:`LoRAAdapter`: one adapter as loaded (``peft.py``), per target module its ``A [r, in]``
  and ``B [out, r]`` with the scaling folded into ``B``.
- :class:`LoRAMapping`: per step, the slot of every token row and of every logits row (``-1`` =
  the base model), set once per step by the runner's :class:`~llmkit.lora.manager.LoRAManager`
  and read by every LoRA layer it built. The layers hold a reference to this object; nothing
  global is involved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmkit.lora.request import LoRALoadError, LoRARequest  # noqa: F401  (re-exported)

#: A row that computes with the base model only.
NO_SLOT = -1


@dataclass(slots=True)
class LoRALayerWeights:
    """One target module's low-rank pair: ``delta(x) = x A^T B^T`` (``B`` already scaled by
    ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). An embedding's ``A`` is ``[r, vocab]``,
    looked up by token id instead of multiplied."""

    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter in memory: its request and, by the model's module name (e.g.
    ``model.layers.0.self_attn.q_proj``, ``lm_head``, ``model.embed_tokens``), its weights."""

    request: LoRARequest
    layers: dict[str, LoRALayerWeights] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.layers.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.layers.values())


class RowSlots:
    """The slot of each row of one matmul input (token rows, or logits rows), with the
    per-slot segments the batched LoRA ops need, computed once per step on first use."""

    __slots__ = ("slots", "_tensor", "_segments", "_sorted", "_sorted_rows", "device")

    def __init__(self, slots: np.ndarray, device: torch.device) -> None:
        self.slots = np.ascontiguousarray(slots, dtype=np.int32)
        self.device = device
        self._tensor: torch.Tensor | None = None
        self._segments: list[tuple[int, slice | torch.Tensor]] | None = None
        self._sorted: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None \
            = None
        self._sorted_rows: tuple[torch.Tensor, list[tuple[int, int, int]]] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @property
    def any(self) -> bool:
        return bool(len(self.slots)) and bool((self.slots >= 0).any())

    @property
    def tensor(self) -> torch.Tensor:
        """int32 ``[rows]`` on the device (``-1`` = base)."""
        if self._tensor is None:
            self._tensor = torch.from_numpy(self.slots).to(self.device)
        return self._tensor

    @property
    def segments(self) -> list[tuple[int, slice | torch.Tensor]]:
        """``(slot, rows)`` for each slot present: a ``slice`` when its rows are contiguous
        (no gather needed), else an int64 index tensor on the device."""
        if self._segments is None:
            segs: list[tuple[int, slice | torch.Tensor]] = []
            for slot in np.unique(self.slots).tolist():
                if slot < 0:
                    continue
                idx = np.flatnonzero(self.slots == slot)
                if idx[-1] - idx[0] + 1 == len(idx):
                    segs.append((slot, slice(int(idx[0]), int(idx[-1]) + 1)))
                else:
                    segs.append((slot, torch.from_numpy(idx).to(self.device)))
            self._segments = segs
        return self._segments

    @property
    def sorted_rows(self) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The rows with a slot sorted by slot (int64 on the device, for one gather and one
        scatter-add per layer) and each slot's ``(slot, lo, hi)`` range in that order."""
        if self._sorted_rows is None:
            rows = np.flatnonzero(self.slots >= 0)
            order = rows[np.argsort(self.slots[rows], kind="stable")]
            slots, starts, lens = np.unique(self.slots[order], return_index=True,
                                            return_counts=True)
            bounds = [(int(s), int(a), int(a + n)) for s, a, n in zip(slots, starts, lens)]
            self._sorted_rows = (torch.from_numpy(order.astype(np.int64)).to(self.device),
                                 bounds)
        return self._sorted_rows

    @property
    def sorted_segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       int]:
        """For the Triton kernels (punica's SGMV over a sorted permutation): the LoRA rows
        sorted by slot (int32), and per segment its start in that order, its length and its
        slot (int32 each), and the longest segment."""
        if self._sorted is None:
            rows = np.flatnonzero(self.slots >= 0)
            order = rows[np.argsort(self.slots[rows], kind="stable")]
            seg_slots, starts, lens = np.unique(self.slots[order], return_index=True,
                                                return_counts=True)
            self._sorted = (self._int32(order), self._int32(starts), self._int32(lens),
                            self._int32(seg_slots), int(lens.max()) if len(lens) else 0)
        return self._sorted


    def _int32(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).to(self.device)


class LoRAMapping:
    """The step's rows -> slots, owned by the runner's LoRA manager and referenced by every
    LoRA layer: ``tokens`` for the layers applied to the step's tokens, ``logits`` for the LM
    head (applied to the rows logits are computed at). ``None`` outside a step, or when no row
    of the step uses an adapter: the layers then add nothing.

    ``token_slots`` holds the same token rows' slots in one persistent int32 tensor (``-1`` past
    the step's rows and for base rows), written every step: a step graph reads it as an input
    (a compiled graph has no Python state to consult)."""

    __slots__ = ("tokens", "logits", "token_slots")

    def __init__(self, max_num_tokens: int = 0, device: torch.device | str = "cpu") -> None:
        self.tokens: RowSlots | None = None
        self.logits: RowSlots | None = None
        self.token_slots = torch.full((max_num_tokens,), NO_SLOT, dtype=torch.int32,
                                      device=device)

    def set(self, tokens: RowSlots | None, logits: RowSlots | None) -> None:
        self.tokens = tokens if tokens is not None and tokens.any else None
        self.logits = logits if logits is not None and logits.any else None

    def write_token_slots(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n > self.token_slots.shape[0]:
            raise RuntimeError(f"the step has {n} tokens, more than the LoRA mapping holds "
                               f"({self.token_slots.shape[0]}: scheduler.max_num_batched_tokens)")
        self.token_slots[:n].copy_(torch.from_numpy(np.ascontiguousarray(slots,
                                                                         dtype=np.int32)))

    def clear(self) -> None:
        self.tokens = self.logits = None
