"""The model's forward for one step: through a step graph where one computes the step, else
eagerly with the attention backend's metadata; a KV connector's per-layer calls inside or
around it (``kv_connector_step``); pipeline stages after the first continue from the previous
stage's tensors.

The step graphs (``compilation.mode=graphs``, made in ``step_graph_capture``) are decode steps
of up to ``max_rows`` rows with one block-table row and one sequence length per row. They
compute a decode-only step, and decoding rows verifying drafts: each draft token is then a
decode row over its context up to itself (every K/V is written before attention).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmkit.compilation.base import StepGraphs
from llmkit.distributed.pipeline import IntermediateTensors
from llmkit.lora.manager import LoRAManager
from llmkit.worker import kv_connector_step
from llmkit.worker.group_metadata import build_group_metadata
from llmkit.worker.input_batch import StepInputs

if TYPE_CHECKING:
    from llmkit.worker.model_runner import ModelRunner

__all__ = ["forward"]


def forward(runner: ModelRunner, inputs: StepInputs, inputs_embeds: torch.Tensor | None = None,
            intermediate_tensors: IntermediateTensors | None = None
            ) -> torch.Tensor | IntermediateTensors:
    """The model's hidden states (or, before the last pipeline stage, the tensors the next
    stage continues from)."""
    graph = (inputs_embeds is None and intermediate_tensors is None
             and _graph_computes(runner.step_graphs, runner.lora_manager, inputs))
    pending = runner.pending_graphs
    # While graphs compile in the background, an eager step waits out any torch.fx trace
    # (step_graph_capture explains why).
    with (pending.eager_step() if pending is not None else contextlib.nullcontext()):
        conn = runner.kv_connector
        if conn is None:
            return _forward_once(runner, inputs, inputs_embeds, intermediate_tensors, graph,
                                 False)
        return kv_connector_step.forward_with_connector(
            conn, runner.kv_caches,
            lambda hooked: _forward_once(runner, inputs, inputs_embeds, intermediate_tensors,
                                         graph, hooked),
            layer_hook=not graph and runner.model.supports_kv_layer_hook)


def _forward_once(runner: ModelRunner, inputs: StepInputs, inputs_embeds: torch.Tensor | None,
                  intermediate_tensors: IntermediateTensors | None, graph: bool,
                  hooked: bool) -> torch.Tensor | IntermediateTensors:
    device = runner.device
    md = inputs.attn_metadata
    ids, positions = inputs.input_ids.to(device), inputs.positions.to(device)
    rope = positions if inputs.rope_positions is None else inputs.rope_positions.to(device)
    if graph:
        return _run_graph(runner.step_graphs, runner.batch.block_table, inputs, ids, positions,
                         rope, device)
    built = runner.attn_backend.build_metadata(md) if not md.group_metadata else \
        build_group_metadata(runner.attn_backend, md, runner.kv_plan)
    if hooked:
        built.kv_layer_hook = runner.kv_connector
    model, kv_caches = runner.model, runner.kv_caches
    if intermediate_tensors is not None:  # a later pipeline stage (no step graphs)
        return model(None, rope, kv_caches, built, intermediate_tensors=intermediate_tensors)
    if inputs_embeds is not None:
        return model(None, rope, kv_caches, built, inputs_embeds)
    return model(ids, rope, kv_caches, built)


def _graph_computes(graphs: StepGraphs | None, lora_manager: LoRAManager | None,
                   inputs: StepInputs) -> bool:
    """Whether a step graph computes this step: a decode-only step it covers, or decoding
    rows verifying drafts (with one position row: M-RoPE prompts run eagerly)."""
    md = inputs.attn_metadata
    if graphs is None or not graphs.covers(md.num_actual_tokens) or not (
            lora_manager is None or lora_manager.step_graphs_allowed):
        return False
    if inputs.rope_positions is not None and inputs.rope_positions.dim() > 1:
        return False
    if md.num_actual_tokens == md.num_reqs:
        return True
    layout = inputs.logits
    return len(layout.rows) == len(inputs.rows) and bool(
        (layout.num_logits == inputs.num_scheduled).all())


def _run_graph(graphs: StepGraphs, block_table: np.ndarray, inputs: StepInputs,
              ids: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor,
              device: torch.device) -> torch.Tensor:
    """The step's hidden states through the graphs (``_graph_computes`` held); ``ids``,
    ``positions`` and ``rope`` already on ``device``; ``block_table`` the batch's."""
    md = inputs.attn_metadata
    rows = inputs.rows
    if md.num_actual_tokens == md.num_reqs:
        return graphs.run(ids, rope, md.slot_mapping.to(device),
                          torch.from_numpy(block_table[rows]).to(device),
                          md.seq_lens.to(device))
    # Verifying drafts: one block-table row and length per token.
    per_token = np.repeat(rows, inputs.num_scheduled)
    return graphs.run(ids, rope, md.slot_mapping.to(device),
                      torch.from_numpy(block_table[per_token]).to(device),
                      (positions + 1).to(torch.int32))
