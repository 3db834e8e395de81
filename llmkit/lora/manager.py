"""The worker's adapters: known, loaded (in memory, LRU) and resident (in slots, LRU).

- *known*: every adapter the engine registered (``add_adapter``): its id, name and folder.
- *loaded*: at most ``lora.max_cpu_loras`` adapters' weights in host memory, least recently
  used evicted first; an evicted adapter is read from its folder again when it runs next.
- *resident*: at most ``lora.max_loras`` adapters copied into the slots of every LoRA layer's
  stacked buffers. Before each step, :meth:`LoRAManager.prepare_step` makes the step's adapters
  resident (evicting the least recently used adapters that the step does not use) and sets the
  step's :class:`~llmkit.lora.base.LoRAMapping`: each token row's and logits row's slot.

The scheduler never puts more distinct adapters into one step than there are slots; a step
that does is a bug, refused here with an error.

A slot's cost is fixed at start-up and logged: ``max_lora_rank * (in + out)`` elements of the
model's dtype for every LoRA layer (each shard of a fused projection counting its own A), plus
``max_lora_rank * (vocab + hidden)`` for the embedding — whatever rank the adapters have.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
from torch import nn

from llmkit.linear.base import LinearMethodFactory
from llmkit.linear.parallel import ColumnParallelLinearMethod, RowParallelLinearMethod
from llmkit.lora.base import (NO_SLOT, LoRAAdapter, LoRALayerWeights, LoRALoadError,
                              LoRAMapping, LoRARequest, RowSlots)
from llmkit.lora.layers import LoRALinearMethod, LoRAVocabEmbedding
from llmkit.lora.peft import LoRATarget, load_peft_adapter
from llmkit.lora.punica import TorchLoRAOps
from llmkit.lora.request import id_taken_message

logger = logging.getLogger(__name__)

_Split = ColumnParallelLinearMethod | RowParallelLinearMethod


def shard_lora_weights(split: _Split, shard: int, w: LoRALayerWeights) -> LoRALayerWeights:
    """A whole adapter pair cut like its tensor-parallel base layer: a column-parallel layer
    keeps B's rows of this rank's output slice (a padded vocabulary tail gets zero rows), a
    row-parallel one A's columns of its input slice (its partial delta joins the layer's
    all-reduce)."""
    if isinstance(split, RowParallelLinearMethod):
        cols = split.local.in_features
        return LoRALayerWeights(w.lora_a.narrow(-1, split.tp.rank * cols, cols).contiguous(),
                                w.lora_b)
    local, start, held = split.parts[split.full.shard_ids[shard]]
    b = w.lora_b.narrow(0, start, held)
    if held < local:
        b = torch.cat([b, b.new_zeros((local - held, b.shape[1]))])
    return LoRALayerWeights(w.lora_a, b.contiguous())


def lora_linear_method_factory(base: LinearMethodFactory, *,
                               packed_modules: dict[str, list[str]], num_slots: int,
                               max_rank: int, mapping: LoRAMapping,
                               ops: TorchLoRAOps) -> LinearMethodFactory:
    """Wrap every linear layer's method in a :class:`LoRALinearMethod`. A fused layer
    (``packed_modules``: vLLM's ``packed_modules_mapping``, e.g. ``qkv_proj -> [q_proj,
    k_proj, v_proj]``) takes its shards' PEFT module names; the LM head (``lm_head``) reads
    the logits rows of the mapping."""

    def make(spec):
        head, _, leaf = spec.prefix.rpartition(".")
        parts = packed_modules.get(leaf)
        if parts is not None:
            if len(parts) != len(spec.shard_ids):
                raise ValueError(f"{spec.prefix}: packed_modules_mapping names {len(parts)} "
                                 f"modules for {len(spec.shard_ids)} shards")
            names = tuple(f"{head}.{p}" if head else p for p in parts)
        elif len(spec.shard_ids) == 1:
            names = (spec.prefix,)
        else:  # a fused layer the model does not map: its shards by id
            names = tuple(f"{spec.prefix}.{s}" for s in spec.shard_ids)
        return LoRALinearMethod(base(spec), spec, num_slots=num_slots, max_rank=max_rank,
                                mapping=mapping, ops=ops, module_names=names,
                                on_logits=spec.prefix == "lm_head")

    return make


class LoRAManager:
    """Adapters of one model (see the module docstring). Built after the model, with the
    mapping its LoRA layers reference."""

    def __init__(self, model: nn.Module, mapping: LoRAMapping, *, num_slots: int,
                 max_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device, ops: TorchLoRAOps) -> None:
        self.mapping = mapping
        self.ops = ops
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self._wrap_embeddings(model, ops)
        # PEFT module name -> (layer, shard index); targets: what an adapter may name.
        self._layers: dict[str, list[tuple[LoRALinearMethod | LoRAVocabEmbedding, int]]] = {}
        self.targets: dict[str, LoRATarget] = {}
        self._linear_methods: list[LoRALinearMethod] = []
        self._embeddings: list[tuple[str, LoRAVocabEmbedding]] = []
        # tensor parallel: the split around each LoRA method (it sees the rank's slice)
        self._splits: dict[int, _Split] = {}
        for name, module in model.named_modules():
            method = getattr(module, "method", None)
            split = None
            if isinstance(method, (ColumnParallelLinearMethod, RowParallelLinearMethod)):
                split, method = method, method.inner
            if isinstance(method, LoRALinearMethod):
                self._linear_methods.append(method)
                # adapters are checked against the whole layer
                in_features, sizes = method.spec.in_features, method.spec.output_sizes
                if isinstance(split, ColumnParallelLinearMethod):
                    sizes = split.full.output_sizes
                elif split is not None:
                    in_features *= split.tp.size
                if split is not None:
                    self._splits[id(method)] = split
                for i, (part, rows) in enumerate(zip(method.module_names, sizes)):
                    self._layers.setdefault(part, []).append((method, i))
                    self.targets[part] = LoRATarget(part, in_features, rows)
            elif isinstance(module, LoRAVocabEmbedding):
                self._embeddings.append((name, module))
                self._layers.setdefault(name, []).append((module, 0))
                self.targets[name] = LoRATarget(name, module.num_embeddings,
                                                module.embedding_dim, embedding=True)
        if not self._linear_methods:
            raise ValueError("lora.enabled=true: the model has no LoRA layers (its linear "
                             "layers were not built with the LoRA linear method)")
        self.known: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._resident: OrderedDict[int, int] = OrderedDict()  # id -> slot, LRU first
        self._free_slots = list(range(num_slots))
        # modules each slot's current adapter wrote (the rest of the slot is zero)
        self._slot_modules: list[set[str]] = [set() for _ in range(num_slots)]
        self.num_loads = 0  # adapters read from disk (incl. re-reads after eviction)
        self.num_activations = 0  # adapters copied into a slot
        logger.info("LoRA: %d slots of rank %d, %.1f MiB each (%d layers); %d adapters kept "
                    "in memory", num_slots, max_rank, self.slot_bytes / 2**20,
                    len(self._linear_methods) + len(self._embeddings), max_cpu_loras)

    def _wrap_embeddings(self, model: nn.Module, ops: TorchLoRAOps) -> None:
        """Put a LoRA wrapper around each token embedding (it is not a linear layer, so the
        linear method factory did not see it)."""
        from llmkit.models.layers.embedding import VocabEmbedding

        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, VocabEmbedding):
                    setattr(module, child_name, LoRAVocabEmbedding(
                        child, num_slots=self.num_slots, max_rank=self.max_rank,
                        mapping=self.mapping, ops=ops))

    @property
    def slot_bytes(self) -> int:
        return (sum(m.stack.nbytes_per_slot for m in self._linear_methods)
                + sum(e.stack.nbytes_per_slot for _, e in self._embeddings))

    # -- adapters --------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> None:
        """Register and load (check) an adapter; raises ``LoRALoadError`` with the reason.
        Adding the same adapter again does nothing."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise LoRALoadError(id_taken_message(known, request))
            return
        adapter = self._read(request)
        self.known[request.lora_int_id] = request
        self._remember(adapter)

    def remove_adapter(self, lora_id: int) -> bool:
        if self.known.pop(lora_id, None) is None:
            return False
        self._loaded.pop(lora_id, None)
        slot = self._resident.pop(lora_id, None)
        if slot is not None:
            self._clear_slot(slot)
            self._free_slots.append(slot)
        return True

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        self.num_loads += 1
        return load_peft_adapter(request, self.targets, max_rank=self.max_rank,
                                 dtype=self.dtype)

    def _remember(self, adapter: LoRAAdapter) -> None:
        lora_id = adapter.request.lora_int_id
        self._loaded[lora_id] = adapter
        self._loaded.move_to_end(lora_id)
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self._loaded.get(lora_id)
        if adapter is not None:
            self._loaded.move_to_end(lora_id)
            return adapter
        request = self.known.get(lora_id)
        if request is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} is not registered with the worker")
        adapter = self._read(request)
        self._remember(adapter)
        return adapter

    @property
    def loaded_ids(self) -> list[int]:
        """Adapters in memory, least recently used first."""
        return list(self._loaded)

    @property
    def resident_ids(self) -> list[int]:
        """Adapters in slots, least recently used first."""
        return list(self._resident)

    # -- slots -----------------------------------------------------------------------------
    def _clear_slot(self, slot: int) -> None:
        for name in self._slot_modules[slot]:
            for layer, _ in self._layers[name]:
                if isinstance(layer, LoRALinearMethod):
                    layer.set_slot(slot, [None] * len(layer.module_names))
                else:
                    layer.set_slot(slot, None)
        self._slot_modules[slot] = set()

    def _activate(self, adapter: LoRAAdapter, slot: int) -> None:
        self._clear_slot(slot)
        written: set[str] = set()
        done: set[int] = set()
        for name in adapter.layers:
            for layer, _ in self._layers[name]:
                if id(layer) in done:
                    continue
                done.add(id(layer))
                if isinstance(layer, LoRALinearMethod):
                    shards = [adapter.layers.get(part) for part in layer.module_names]
                    split = self._splits.get(id(layer))
                    if split is not None:
                        shards = [None if w is None else shard_lora_weights(split, i, w)
                                  for i, w in enumerate(shards)]
                    layer.set_slot(slot, shards)
                    written.update(p for p in layer.module_names if p in adapter.layers)
                else:
                    layer.set_slot(slot, adapter.layers[name])
                    written.add(name)
        self._slot_modules[slot] = written
        self.num_activations += 1

    def _slot_for(self, lora_id: int, needed: set[int]) -> int:
        slot = self._resident.get(lora_id)
        if slot is not None:
            self._resident.move_to_end(lora_id)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop(0)
        else:
            victim = next((i for i in self._resident if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"the step uses more distinct LoRA adapters than there are "
                                   f"slots ({self.num_slots}); the scheduler must not do that")
            slot = self._resident.pop(victim)
        self._activate(self._adapter(lora_id), slot)
        self._resident[lora_id] = slot
        return slot

    # -- the step --------------------------------------------------------------------------
    def _slots(self, lora_ids: np.ndarray, slot_of: dict[int, int]) -> RowSlots:
        slots = np.full(len(lora_ids), NO_SLOT, dtype=np.int32)
        for lora_id, slot in slot_of.items():
            slots[lora_ids == lora_id] = slot
        return RowSlots(slots, self.device)

    def prepare_step(self, token_lora_ids: np.ndarray, logits_lora_ids: np.ndarray) -> None:
        """Make the step's adapters resident and set the mapping. ``*_lora_ids``: the adapter
        id of each token row / logits row (0 = the base model)."""
        needed = {int(i) for i in np.unique(token_lora_ids) if i > 0}
        needed |= {int(i) for i in np.unique(logits_lora_ids) if i > 0}
        if not needed:
            self.mapping.clear()
            self.mapping.write_token_slots(np.full(len(token_lora_ids), NO_SLOT, np.int32))
            return
        if len(needed) > self.num_slots:
            raise RuntimeError(f"the step uses {len(needed)} distinct LoRA adapters but there "
                               f"are {self.num_slots} slots (lora.max_loras); the scheduler "
                               "must not do that")
        slot_of = {i: self._slot_for(i, needed) for i in sorted(needed)}
        tokens = self._slots(token_lora_ids, slot_of)
        self.mapping.set(tokens, self._slots(logits_lora_ids, slot_of))
        self.mapping.write_token_slots(tokens.slots)

    @property
    def step_graphs_allowed(self) -> bool:
        """Whether this step may run through a step graph: always where the LoRA ops work
        inside graphs (they read ``mapping.token_slots``), else only when no token row of the
        step uses an adapter (the graph then computes the base model, as it was captured)."""
        return self.ops.supports_step_graphs or self.mapping.tokens is None

    def end_step(self) -> None:
        self.mapping.clear()

    def logits_fn(self, lora_id: int,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``compute_logits`` for rows that all belong to one request (prompt logprobs): its
        adapter's slot for every row, the step's logits mapping restored afterwards."""
        if lora_id <= 0:
            def base(hidden: torch.Tensor) -> torch.Tensor:
                saved, self.mapping.logits = self.mapping.logits, None
                try:
                    return compute_logits(hidden)
                finally:
                    self.mapping.logits = saved
            return base
        slot = self._resident[lora_id]

        def with_adapter(hidden: torch.Tensor) -> torch.Tensor:
            saved = self.mapping.logits
            self.mapping.logits = RowSlots(np.full(hidden.shape[0], slot, dtype=np.int32),
                                           self.device)
            try:
                return compute_logits(hidden)
            finally:
                self.mapping.logits = saved
        return with_adapter


class LoRASetup:
    """What ``lora.enabled`` adds to the model: every linear method wrapped by the LoRA method
    (all sharing one mapping and one set of batched ops), then the manager of its slots."""

    def __init__(self, lora_config, source, platform, dtype: torch.dtype, *,
                 max_num_tokens: int) -> None:
        from llmkit.lora.punica import lora_ops_for
        from llmkit.models import get_model_class

        self.config = lora_config
        self.platform = platform
        self.dtype = dtype
        self.mapping = LoRAMapping(max_num_tokens, platform.device)
        self.ops = lora_ops_for(platform.device, platform.native_kernels(dtype),
                                platform.dispatch)
        self.packed = dict(get_model_class(source.hf_config).packed_modules_mapping)

    def wrap(self, factory: LinearMethodFactory) -> LinearMethodFactory:
        return lora_linear_method_factory(factory, packed_modules=self.packed,
                                          num_slots=self.config.max_loras,
                                          max_rank=self.config.max_lora_rank,
                                          mapping=self.mapping, ops=self.ops)

    def manager(self, model: nn.Module) -> "LoRAManager":
        return LoRAManager(model, self.mapping, num_slots=self.config.max_loras,
                           max_rank=self.config.max_lora_rank,
                           max_cpu_loras=self.config.cpu_capacity, dtype=self.dtype,
                           device=self.platform.device, ops=self.ops)


__all__ = ["LoRAManager", "LoRALoadError", "LoRASetup", "lora_linear_method_factory"]
