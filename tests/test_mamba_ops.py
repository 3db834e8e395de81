"""Mamba-2's recurrent platform ops (``llmkit/ops/mamba.py``) against transformers' torch path
(``modeling_bamba``'s ``mamba2_chunk_scan``, ``mamba2_selective_state_update``,
``causal_conv1d_fn``, ``causal_conv1d_update``) on the same inputs: a sequence cut into chunks
at any points, its state carried in a block between them, gives the whole sequence's outputs and
final state; a one-token piece takes the decode update."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from llmkit.ops.base import ModelOps
from llmkit.ops.mamba import RecurrentBatch, ssd_chunk_scan

hf = pytest.importorskip("transformers.models.bamba.modeling_bamba")

H, P, N, G, CHUNK = 4, 8, 16, 2, 8  # heads, head dim, state, groups, SSD chunk
CONV_DIM, K = 24, 4
OPS = ModelOps()
TOL = dict(atol=2e-5, rtol=1e-4)


def _inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(length, H, P, generator=g),
                dt=torch.randn(length, H, generator=g) - 1.0,
                B=torch.randn(length, G, N, generator=g),
                C=torch.randn(length, G, N, generator=g))


def _params(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return dict(A=-torch.exp(torch.rand(H, generator=g) * 2), D=torch.randn(H, generator=g),
                dt_bias=torch.randn(H, generator=g) * 0.5)


def _hf_scan(inp, prm, initial=None):
    return hf.mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], prm["A"], inp["B"][None], inp["C"][None],
        chunk_size=CHUNK, D=prm["D"], dt_bias=prm["dt_bias"], dt_softplus=True,
        initial_states=initial, return_final_states=True)


def _batch(lens: list[int], blocks: list[int], has_state: list[bool]) -> RecurrentBatch:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return RecurrentBatch(qsl, torch.tensor(blocks), has_state)


def _scan(inp, prm, state, batch):
    return OPS.ssd_scan(inp["x"], inp["dt"], prm["A"], inp["B"], inp["C"], prm["D"],
                        prm["dt_bias"], state, batch, CHUNK)


def _cut(inp, a: int, b: int):
    return {k: v[a:b] for k, v in inp.items()}


@pytest.mark.parametrize("length", [1, 7, 8, 29])
def test_whole_sequence_scan_matches_transformers(length):
    inp, prm = _inputs(length), _params()
    y_ref, final_ref = _hf_scan(inp, prm)
    state = torch.full((3, H, P, N), 7.0)  # a stale block: a fresh request starts from zeros
    y = _scan(inp, prm, state, _batch([length], [2], [False]))
    torch.testing.assert_close(y, y_ref[0], **TOL)
    torch.testing.assert_close(state[2], final_ref[0], **TOL)
    assert torch.equal(state[:2], torch.full((2, H, P, N), 7.0))  # other blocks untouched


def test_scan_from_a_carried_state_matches_transformers():
    inp, prm = _inputs(13), _params()
    initial = torch.randn(1, H, P, N)
    y_ref, final_ref = _hf_scan(inp, prm, initial)
    state = initial.clone()
    y = _scan(inp, prm, state, _batch([13], [0], [True]))
    torch.testing.assert_close(y, y_ref[0], **TOL)
    torch.testing.assert_close(state[0], final_ref[0], **TOL)


def test_decode_update_matches_transformers():
    inp, prm = _inputs(3), _params()
    states = torch.randn(3, H, P, N)
    ref_states = states.clone()
    # transformers' decode form takes per-(head, head_dim) dt / A / D, as its mixer expands them
    y_ref = hf.mamba2_selective_state_update(
        ref_states, inp["x"], inp["dt"][:, :, None].expand(-1, -1, P),
        prm["A"][:, None, None].expand(-1, P, N), inp["B"], inp["C"],
        prm["D"][:, None].expand(-1, P), dt_bias=prm["dt_bias"][:, None].expand(-1, P),
        dt_softplus=True)
    y = OPS.ssm_state_update(inp["x"], inp["dt"], prm["A"], inp["B"], inp["C"], prm["D"],
                             prm["dt_bias"], states, torch.tensor([0, 1, 2]))
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(states, ref_states, **TOL)


@pytest.mark.parametrize("seed", range(6))
def test_any_split_into_chunks_equals_the_whole_scan(seed):
    """Cut points at random (one-token pieces included: the decode update), the state carried
    in block 1 between pieces: the outputs and final state of the whole sequence."""
    length = 41
    inp, prm = _inputs(length, seed), _params(seed + 10)
    y_ref, final_ref = _hf_scan(inp, prm)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, length), rng.randint(1, 12)))
    state = torch.randn(2, H, P, N)
    ys = []
    for i, (a, b) in enumerate(zip([0] + cuts, cuts + [length])):
        ys.append(_scan(_cut(inp, a, b), prm, state, _batch([b - a], [1], [i > 0])))
    torch.testing.assert_close(torch.cat(ys), y_ref[0], **TOL)
    torch.testing.assert_close(state[1], final_ref[0], **TOL)


def test_a_mixed_batch_equals_each_request_alone():
    """Decodes, a continued prefill chunk and a fresh prompt in one flat batch: each request's
    rows and state as if it ran alone."""
    prm = _params()
    lens, blocks, has = [1, 6, 9, 1], [3, 0, 2, 1], [True, True, False, True]
    inps = [_inputs(n, 20 + i) for i, n in enumerate(lens)]
    start = torch.randn(4, H, P, N)
    alone_state, ys = start.clone(), []
    for inp, n, blk, h in zip(inps, lens, blocks, has):
        ys.append(_scan(inp, prm, alone_state, _batch([n], [blk], [h])))
    flat = {k: torch.cat([i[k] for i in inps]) for k in inps[0]}
    state = start.clone()
    y = _scan(flat, prm, state, _batch(lens, blocks, has))
    torch.testing.assert_close(y, torch.cat(ys), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, alone_state, atol=1e-6, rtol=1e-6)


def test_chunk_scan_is_transformers_chunk_scan_for_one_sequence():
    inp, prm = _inputs(20), _params()
    dt = F.softplus(inp["dt"] + prm["dt_bias"])
    y, final = ssd_chunk_scan(inp["x"], dt, prm["A"], inp["B"].repeat_interleave(H // G, 1),
                              inp["C"].repeat_interleave(H // G, 1), CHUNK)
    y_ref, final_ref = hf.mamba2_chunk_scan(
        inp["x"][None], dt[None], prm["A"], inp["B"][None], inp["C"][None], chunk_size=CHUNK,
        return_final_states=True)
    torch.testing.assert_close(y, y_ref[0], **TOL)
    torch.testing.assert_close(final, final_ref[0], **TOL)


# -- the causal conv1d -----------------------------------------------------------------------
def _conv_params(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CONV_DIM, K, generator=g), torch.randn(CONV_DIM, generator=g)


@pytest.mark.parametrize("seed", range(4))
def test_conv1d_in_chunks_equals_transformers_whole(seed):
    length = 23
    weight, bias = _conv_params()
    x = torch.randn(length, CONV_DIM, generator=torch.Generator().manual_seed(seed))
    ref = hf.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, length), rng.randint(1, 8)))
    state = torch.randn(2, CONV_DIM, K - 1)  # block 0 stale: the first piece starts from zeros
    outs = [OPS.causal_conv1d(x[a:b], weight, bias, state, _batch([b - a], [0], [i > 0]))
            for i, (a, b) in enumerate(zip([0] + cuts, cuts + [length]))]
    torch.testing.assert_close(torch.cat(outs), ref, **TOL)
    torch.testing.assert_close(state[0], x[-(K - 1):].t())


def test_conv1d_decode_matches_transformers_update():
    weight, bias = _conv_params()
    x = torch.randn(3, CONV_DIM)
    state = torch.randn(3, CONV_DIM, K - 1)
    blocks = [2, 0, 1]  # row r's state is in block blocks[r]
    # transformers keeps d_conv inputs (the oldest drops out of the window): pad one column
    ref_state = torch.cat([torch.zeros(3, CONV_DIM, 1), state[blocks]], -1)
    ref = hf.causal_conv1d_update(x[:, :, None], ref_state, weight, bias, activation="silu")
    out = OPS.causal_conv1d(x, weight, bias, state, _batch([1, 1, 1], blocks, [True] * 3))
    torch.testing.assert_close(out, ref[:, :, 0], **TOL)
    torch.testing.assert_close(state[blocks], ref_state[:, :, 1:])


# -- the CPU platform's C++ decode update ------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_ops():
    from llmkit.config.schema import PlatformConfig
    from llmkit.platforms.cpu import CpuPlatform

    ops = CpuPlatform(PlatformConfig(name="cpu", native_kernels="on")).ops(torch.float32)
    assert ops.name == "cpu"
    return ops


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_cpu_decode_update_matches_the_reference(cpu_ops, dt_limit):
    """The C++ kernel over a state tensor laid out as the runner's pool views it (blocks
    strided through a larger page, contiguous within), rows in another order than blocks."""
    inp, prm = _inputs(5, seed=7), _params(8)
    page = torch.randn(6, H * P * N + 40)  # 40 floats of another layer's bytes per page
    state = page[:, 8:8 + H * P * N].view(6, H, P, N)
    ref_page = page.clone()
    ref_state = ref_page[:, 8:8 + H * P * N].view(6, H, P, N)
    blocks = torch.tensor([4, 0, 5, 2, 1])
    args = (inp["x"], inp["dt"], prm["A"], inp["B"], inp["C"], prm["D"], prm["dt_bias"])
    y = cpu_ops.ssm_state_update(*args, state, blocks, dt_limit)
    y_ref = OPS.ssm_state_update(*args, ref_state, blocks, dt_limit)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(page, ref_page, atol=1e-5, rtol=1e-5)  # only the states moved
    assert torch.equal(page[:, :8], ref_page[:, :8]) and torch.equal(page[3], ref_page[3])
