"""Mixture of experts (issue 22 item 5): the fused-MoE op's three paths against its
definition, the MoE architectures against Hugging Face, tensor and expert parallel against
the single-process engine, and the start-up errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit.ops.moe import fused_moe_grouped, fused_moe_reference, fused_topk


def _moe_case(t: int, hidden: int = 32, inter: int = 24, experts: int = 6, top_k: int = 2,
              seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = fused_topk(torch.randn(t, experts, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _by_hand(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def test_topk_softmax_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = fused_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int32
    torch.testing.assert_close(w, probs[:, :2])
    w, _ = fused_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w, probs[:, :2] / probs[:, :2].sum())


def test_reference_is_the_definition():
    case = _moe_case(5)
    torch.testing.assert_close(fused_moe_reference(*case), _by_hand(*case))


@pytest.mark.parametrize("t", [1, 9, 40])  # decode-sized, a few tokens, more than the experts
def test_grouped_cpu_path_matches_the_reference(t):
    case = _moe_case(t)
    torch.testing.assert_close(fused_moe_grouped(*case), fused_moe_reference(*case))


def test_expert_parallel_parts_sum_to_the_whole():
    x, w13, w2, weights, ids = _moe_case(12)
    whole = fused_moe_reference(x, w13, w2, weights, ids)
    parts = []
    for rank in range(2):  # 6 experts over 2 ranks: rank r holds experts 3r..3r+2
        emap = torch.full((6,), -1, dtype=torch.int32)
        emap[3 * rank:3 * rank + 3] = torch.arange(3, dtype=torch.int32)
        local = (w13[3 * rank:3 * rank + 3], w2[3 * rank:3 * rank + 3])
        part = fused_moe_grouped(x, *local, weights, ids, emap)
        torch.testing.assert_close(part, fused_moe_reference(x, *local, weights, ids, emap))
        parts.append(part)
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_grouped_path_is_one_opaque_op_in_a_compiled_graph():
    case = _moe_case(4)
    compiled = torch.compile(fused_moe_grouped, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*case), fused_moe_reference(*case))


@pytest.mark.parametrize("t,expert_parallel", [(1, False), (21, False), (21, True)])
def test_triton_fused_moe_interpreted_matches_the_reference(monkeypatch, t, expert_parallel):
    pytest.importorskip("triton")
    from llmkit.kernels import count_launches, fused_moe

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w13, w2, weights, ids = _moe_case(t)
    emap = None
    if expert_parallel:  # this rank holds experts 2..4 of 6
        emap = torch.tensor([-1, -1, 0, 1, 2, -1], dtype=torch.int32)
        w13, w2 = w13[2:5], w2[2:5]
    want = fused_moe_reference(x, w13, w2, weights, ids, emap)
    with count_launches() as launches:
        got = fused_moe(x, w13, w2, weights, ids, emap)
    assert launches["_fused_moe_kernel"] == 2 and launches["_silu_and_mul_kernel"] == 1
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_align_block_size_groups_slots_by_expert_in_whole_blocks():
    pytest.importorskip("triton")
    from llmkit.kernels import moe_align_block_size

    ids = torch.tensor([2, 0, 2, 3, 0, 2])  # 3 = another rank's expert (3 local experts)
    slots, experts = moe_align_block_size(ids, 3, 4)
    assert slots.shape[0] == experts.shape[0] * 4
    # expert 0: slots 1, 4 (+ padding); expert 1: none; expert 2: slots 0, 2, 5
    assert slots[:8].tolist() == [1, 4, 6, 6, 0, 2, 5, 6]
    assert experts.tolist()[:2] == [0, 2] and set(experts.tolist()[2:]) == {3}
