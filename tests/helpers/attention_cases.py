"""Comparing attention backends with the ``torch`` reference: a random attention step (metadata
as ``ModelRunner.prepare_inputs`` builds it, q/k/v as the model hands them over, a filled
cache), and a whole engine's greedy tokens with a given backend."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.attention.base import AttentionBackend, AttentionMetadata


def step_metadata(q_lens, ctx_lens, block_size, block_table, pad_tokens=0) -> AttentionMetadata:
    """Step metadata like ModelRunner.prepare_inputs builds; ``pad_tokens`` extra rows at the
    end of q/k/v with slot -1 (not written, not attended)."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        for p in range(c, c + q):
            slots.append(int(block_table[i, p // block_size]) * block_size + p % block_size)
    slots += [-1] * pad_tokens
    return AttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=qsl[-1], max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens, block_size=block_size)


@dataclass
class AttentionCase:
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor  # for the backend under test
    cache_ref: torch.Tensor  # an identical copy for the reference
    scale: float


def attention_case(q_lens, ctx_lens, num_heads, num_kv_heads, seed, *, head_dim=32,
                   block_size=16, num_blocks=24, pad_tokens=2) -> AttentionCase:
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=g)[:len(q_lens) * 6] \
        .view(len(q_lens), 6).to(torch.int32)
    meta = step_metadata(q_lens, ctx_lens, block_size, block_table, pad_tokens=pad_tokens)
    n = meta.num_actual_tokens + pad_tokens
    q = torch.randn(n, num_heads, head_dim, generator=g)
    kv = torch.randn(n, 2 * num_kv_heads, head_dim, generator=g)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided views, as in the model
    shape = AttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    cache_ref = torch.randn(shape, generator=g)
    return AttentionCase(meta, q, k, v, cache_ref.clone(), cache_ref, head_dim ** -0.5)


def engine_greedy_tokens(model_dir, attention: str, prompts, params, **groups):
    """``(token ids per prompt, cached prompt tokens in all)`` of a float32 ``LLM`` on
    ``model_dir`` with ``attention``; checks that backend ran and every KV block came back."""
    from llmkit import LLM

    llm = LLM(str(model_dir), dtype="float32", attention=attention, **groups)
    outs = llm.generate(prompts, params, use_tqdm=False)
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert type(llm.engine.executor.runner.attn_backend).name == attention
    return [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)
