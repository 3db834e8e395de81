"""KV-cache groups (issue 33): grouping of per-layer specs, and the hybrid manager over one
pool with full-attention, sliding-window and recurrent-state groups (fake specs: no model)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmkit.attention.kv_spec import (FullAttentionSpec, MLASpec, RecurrentStateSpec,
                                      SlidingWindowSpec)
from llmkit.kv_cache.base import KVCacheIntegrityError
from llmkit.kv_cache.groups import (KVCacheGroup, blocks_per_request, describe_groups,
                                    group_kv_cache_specs, is_single_group)
from llmkit.kv_cache.hybrid import HybridKVCacheManager
from llmkit.request import Request
from llmkit.sampling.params import SamplingParams

FULL = FullAttentionSpec(2, 16)
REC = RecurrentStateSpec(((4, 3), (2, 8, 8)))


def sw(w: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(2, 16, sliding_window=w)


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


# -- grouping ------------------------------------------------------------------------------
def test_equal_specs_form_one_group():
    groups = group_kv_cache_specs([FULL] * 4)
    assert groups == [KVCacheGroup(FULL, (0, 1, 2, 3))]
    assert is_single_group(groups)
    assert is_single_group(group_kv_cache_specs([MLASpec(512, 64)] * 3))
    assert not is_single_group(group_kv_cache_specs([sw(8)] * 3))
    assert not is_single_group(group_kv_cache_specs([REC] * 3))


def test_gemma3_interleave_splits_into_groups_of_the_full_layers_count():
    # 5 sliding : 1 full, 12 layers: 10 sliding, 2 full -> groups of 2 layers each
    specs = [FULL if i % 6 == 5 else sw(512) for i in range(12)]
    groups = group_kv_cache_specs(specs)
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert all(specs[i] == g.spec for g in groups for i in g.layer_ids)
    assert describe_groups(groups) == ("5 x sliding_window(512) [layers 0-4, 6-10], "
                                       "1 x full [layers 5, 11]")
    # Uneven counts: the last chunk of a spec is shorter (vLLM pads it).
    groups = group_kv_cache_specs([REC, REC, REC, FULL, REC, FULL])
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 4), (3, 5)]


def test_blocks_per_request_bounds_windows_and_states():
    groups = group_kv_cache_specs([FULL, sw(9), REC])
    # 100 tokens of 4: full 25 blocks, a window of 9 needs ceil(8/4)+1 = 3, the state 1
    assert blocks_per_request(groups, 100, 4) == 25 + 3 + 1


# -- the hybrid manager -------------------------------------------------------------------
def manager(specs, num_blocks=40, bs=4, caching=True, **kw) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, bs, enable_prefix_caching=caching,
                                groups=group_kv_cache_specs(specs), **kw)


def admit(m, req, n=None):
    hits, n_hit = m.get_computed_blocks(req)
    if n is None:
        n = req.num_tokens - n_hit
    new = m.allocate_slots(req, n, new_computed_blocks=hits, num_new_computed_tokens=n_hit)
    if new is not None:
        req.num_computed_tokens = n_hit
    return hits, n_hit, new


def test_sliding_window_frees_blocks_behind_the_window_while_running():
    m = manager([FULL, sw(6)], num_blocks=60)
    null = m.null_block.block_id
    r = make_req("r", list(range(10)))
    _, _, new = admit(m, r)
    assert [len(g) for g in new] == [3, 3]  # 10 tokens of 4: 3 blocks in each group
    r.num_computed_tokens = 10
    for step in range(30):  # decode: one token a step
        r.append_output_token(100 + step)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        m.check_integrity()
        full_ids, win_ids = m.get_block_ids("r")
        assert null not in full_ids and len(full_ids) == -(-r.num_computed_tokens // 4)
        # Keys of positions >= computed - 6 + 1 are still read: their blocks are held.
        first_needed = (r.num_computed_tokens - 1 - 6 + 1) // 4
        assert all(b == null for b in win_ids[:first_needed - 1])
        assert null not in win_ids[first_needed:]
        held = sum(b != null for b in win_ids)
        assert held <= -(-(6 - 1) // 4) + 2  # bounded by the window, not the length
    m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == m.num_blocks - 1  # all back but the null block


def test_recurrent_state_holds_one_block_and_turns_prefix_caching_off(caplog):
    m = manager([REC, FULL, REC, REC], num_blocks=20)
    assert not m.enable_prefix_caching
    assert "recurrent state" in caplog.text
    r = make_req("r", list(range(13)))
    _, n_hit, new = admit(m, r)
    assert n_hit == 0
    assert [len(g) for g in new] == [1, 1, 1, 4]  # groups of 1 layer: 3 x recurrent, 1 x full
    r.num_computed_tokens = 13
    for step in range(10):
        r.append_output_token(step)
        new = m.allocate_slots(r, 1)
        assert not any(new[:3])  # the states never grow
        r.num_computed_tokens += 1
    assert [len(ids) for ids in m.get_block_ids("r")] == [1, 1, 1, 6]
    m.check_integrity()
    m.free(r)
    assert m.num_free_blocks == 19 and m.usage == 0.0


def test_hybrid_prefix_hit_is_the_longest_prefix_every_group_serves():
    m = manager([FULL, sw(5)], num_blocks=80)
    a = make_req("a", list(range(40)))
    admit(m, a)
    a.num_computed_tokens = 40
    # Running on, a's window group gave back its early blocks (still cached, free).
    for step in range(8):
        a.append_output_token(500 + step)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    m.check_integrity()
    # b shares a's first 40 tokens: the full group could serve 9 blocks, the window group
    # needs only the last ceil(4/4)=1 block before the hit's end: 9 blocks for both.
    b = make_req("b", list(range(40)) + [7, 7, 7])
    hits, n_hit, new = admit(m, b)
    assert n_hit == 40
    null = m.null_block
    assert all(x is not null for x in hits[0]) and len(hits[0]) == 10
    assert len(hits[1]) == 10 and hits[1][-1] is not null and hits[1][0] is null
    m.check_integrity()
    # Evict the window group's block just before 40 from the cache: the hit shrinks to the
    # longest prefix whose window is still cached in that group.
    m.free(a)
    m.free(b)
    win = m.managers[1]
    block = m.block_pool.cached_block_hash_to_block[b.block_hashes[9] + win.tag]
    m.block_pool.evictor.remove(block)
    del m.block_pool.cached_block_hash_to_block[block.block_hash]
    block.block_hash = None
    m.block_pool.empty_block_queue.append(block)
    m.check_integrity()
    c = make_req("c", list(range(40)) + [8])
    hits, n_hit, _ = admit(m, c)
    assert n_hit == 36 and len(hits[0]) == len(hits[1]) == 9
    m.free(c)
    m.check_integrity()


def test_allocation_is_all_groups_or_none():
    m = manager([FULL, sw(4)], num_blocks=9)  # 8 usable
    a = make_req("a", list(range(16)))
    _, _, new = admit(m, a)
    assert [len(g) for g in new] == [4, 4]
    b = make_req("b", list(range(100, 104)))
    free_before = m.num_free_blocks
    assert admit(m, b)[2] is None  # 2 blocks needed, none free
    assert m.num_free_blocks == free_before
    assert m.get_block_ids("b") == ([], [])
    m.check_integrity()


def test_one_groups_new_blocks_never_evict_another_groups_hit():
    """Every group takes its hit blocks before any group allocates: the window group's free
    cached hit is next in line for eviction when the full group allocates."""
    m = manager([FULL, sw(5)], num_blocks=9)  # 8 usable
    a = make_req("a", list(range(16)))
    admit(m, a)
    m.free(a)  # freed tail first, group by group: full b3..b0, then window b3 (its hit) ...
    b = make_req("b", list(range(16)) + [9, 9, 9, 9])
    hits, n_hit, new = admit(m, b)
    assert n_hit == 16 and new is not None
    assert all(h.ref_cnt == 1 for g in hits for h in g if h is not m.null_block)
    m.check_integrity()
    assert set(m.get_block_ids("b")[0]).isdisjoint(m.get_block_ids("b")[1])


def test_shrink_slots_gives_back_every_groups_tail():
    """Rejected draft tokens' slots go back in every group, the kept tokens' blocks stay."""
    m = manager([FULL, sw(8)])
    r = make_req("r", list(range(10)))
    admit(m, r)
    r.num_computed_tokens = 10
    assert m.allocate_slots(r, 1, num_lookahead_tokens=8) is not None  # 19 slots: 5 blocks
    assert [len(ids) for ids in m.get_block_ids("r")] == [5, 5]
    free = m.num_free_blocks
    assert m.shrink_slots(r, 11) == 4  # 11 tokens keep 3 blocks in each group
    assert [len(ids) for ids in m.get_block_ids("r")] == [3, 3]
    assert m.num_free_blocks == free + 4
    m.check_integrity()
    m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == m.num_blocks - 1


def test_integrity_checker_sees_a_block_in_two_groups():
    m = manager([FULL, sw(8)])
    r = make_req("r", list(range(8)))
    admit(m, r)
    full, win = m.managers
    win.req_to_blocks["r"][0] = full.req_to_blocks["r"][0]
    with pytest.raises(KVCacheIntegrityError):
        m.check_integrity()


def test_pinned_prefixes_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache.pinned_prefixes"):
        manager([FULL, sw(8)], pinned_prefixes=[[1, 2, 3, 4]])


SPEC_SETS = [
    [FULL, sw(5), FULL, sw(5)],
    [sw(3), sw(9), FULL],
    [REC, FULL, REC],
    [sw(6), sw(6)],  # one window group (Mistral): still the hybrid manager
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(SPEC_SETS) - 1),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7), st.integers(1, 9)),
                 min_size=1, max_size=50),
    caching=st.booleans(),
)
def test_random_workload_across_groups(which, ops, caching):
    """Admit (with hits), step (chunked prefill / decode), preempt and finish at random: the
    bookkeeping stays consistent, every hit block of every group holds exactly that group's
    KV of that prefix, a block id is never held by two groups, no token is written into the
    null block, a window's held blocks stay bounded, and every block comes back at the end."""
    specs = SPEC_SETS[which]
    bs = 4
    m = manager(specs, num_blocks=30, bs=bs, caching=caching)
    null = m.null_block
    prompts = [list(range(1, 14)), list(range(1, 9)) + [5] * 9, [3] * 21, list(range(1, 6))]
    content: dict[int, tuple] = {}  # block id -> (group, the token prefix its KV is of)
    running: dict[str, Request] = {}
    counter = 0

    def write(req: Request, start: int, end: int) -> None:
        """The model computed tokens [start, end): their slots, in every attention group."""
        for g, mg in enumerate(m.managers):
            blocks = mg.req_to_blocks[req.request_id]
            if isinstance(mg.spec, RecurrentStateSpec):
                assert len(blocks) == 1 and blocks[0] is not null
                content[blocks[0].block_id] = (g, "state")
                continue
            for pos in range(start, end):
                blk = blocks[pos // bs]
                assert blk is not null, f"token {pos} of group {g} written into the null block"
                i = pos // bs
                content[blk.block_id] = (g, tuple(req.all_token_ids[:(i + 1) * bs]))

    def check_window(req: Request) -> None:
        """Right after a running request's allocation: a window group holds exactly the
        blocks from the first one its next token's window reads (the null block before)."""
        for mg in m.managers:
            if isinstance(mg.spec, SlidingWindowSpec):
                blocks = mg.req_to_blocks[req.request_id]
                first = max(0, (req.num_computed_tokens - mg.window + 1) // bs)
                assert [b is null for b in blocks] == \
                    [True] * first + [False] * (len(blocks) - first)

    def one_owner() -> None:
        owner: dict[int, int] = {}
        for g, mg in enumerate(m.managers):
            for blocks in mg.req_to_blocks.values():
                for b in blocks:
                    if b is not null:
                        assert owner.setdefault(b.block_id, g) == g, "a block in two groups"

    for kind, which_req, n in ops:
        if kind <= 1:  # admit
            counter += 1
            req = make_req(f"q{counter}", prompts[which_req % len(prompts)] + [counter % 3] * n)
            hits, n_hit = m.get_computed_blocks(req)
            for g, hit in enumerate(hits):
                for i, b in enumerate(hit):
                    if b is not null:
                        assert content.get(b.block_id) == (g, tuple(req.all_token_ids[:(i + 1) * bs]))
            chunk = min(req.num_tokens - n_hit, 3 * n)
            new = m.allocate_slots(req, chunk, new_computed_blocks=hits,
                                   num_new_computed_tokens=n_hit)
            if new is not None:
                req.num_computed_tokens = n_hit
                write(req, n_hit, n_hit + chunk)
                req.num_computed_tokens += chunk
                running[req.request_id] = req
        elif kind <= 3 and running:  # a step of a running request
            req = list(running.values())[which_req % len(running)]
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token(counter % 7 + which_req)
            todo = req.num_tokens - req.num_computed_tokens
            chunk = min(todo, n)
            if m.allocate_slots(req, chunk) is not None:
                check_window(req)
                start = req.num_computed_tokens
                write(req, start, start + chunk)
                req.num_computed_tokens += chunk
        elif kind == 4 and running:  # preempt: free everything, recompute later
            req = running.pop(list(running)[which_req % len(running)])
            m.free(req)
            req.num_computed_tokens = 0
        elif running:  # finish
            m.free(running.pop(list(running)[which_req % len(running)]))
        m.check_integrity()
        one_owner()
    for req in running.values():
        m.free(req)
    m.check_integrity()
    assert m.num_free_blocks == m.num_blocks - 1
    assert m.usage == 0.0


# -- the pool's layout (worker/kv_cache_setup.py) --------------------------------------------
def _pool(specs, block_size=4, num_blocks=6, dtype=None):
    import torch

    from llmkit.attention.torch_backend import TorchAttentionBackend
    from llmkit.worker.kv_cache_setup import allocate_kv_caches, plan_kv_cache

    dtype = dtype or torch.float32
    backend = TorchAttentionBackend()
    plan = plan_kv_cache(specs, block_size, dtype, dtype, backend)
    return plan, allocate_kv_caches(plan, num_blocks, backend, torch.device("cpu"))


def _block_bytes_of(cache, block: int) -> set[int]:
    """The bytes of the raw storage that block ``block`` covers in one layer's view (K and V
    rows of an attention cache, every state tensor of a recurrent one)."""
    import torch

    views = cache if isinstance(cache, tuple) else (cache[0], cache[1])
    out: set[int] = set()
    for v in views:
        sub = v[block]
        elt = sub.element_size()
        idx = torch.tensor(sub.storage_offset())
        for d, (n, st) in enumerate(zip(sub.shape, sub.stride())):
            shape = [1] * sub.dim()
            shape[d] = n
            idx = idx + (torch.arange(n) * st).view(shape)
        for start in (idx.flatten() * elt).tolist():
            out.update(range(start, start + elt))
    return out


@pytest.mark.parametrize("specs", [
    [FULL, sw(8), FULL, sw(8)],
    [REC, FULL, REC, REC],
    [RecurrentStateSpec(((40, 3), (4, 16, 16))), FullAttentionSpec(2, 16)],
    [REC, REC],
])
def test_a_block_id_is_the_same_bytes_in_every_layer_viewing_a_tensor(specs):
    """Layers sharing a raw tensor (layer j of every group) see block b in the same bytes:
    whatever group holds b, no other block's memory is touched."""
    plan, caches = _pool(specs)
    assert plan.num_groups > 1 or specs == [REC, REC]
    by_tensor: dict[int, list[int]] = {}
    for layer, t in enumerate(plan.layer_to_tensor):
        by_tensor.setdefault(t, []).append(layer)
    for t, layers in by_tensor.items():
        raws = {(c if isinstance(c, tuple) else (c,))[0].untyped_storage().data_ptr()
                for c in (caches[i] for i in layers)}
        assert len(raws) == 1, "layers of one tensor index must share its memory"
        for b in range(6):
            mine = [_block_bytes_of(caches[i], b) for i in layers]
            others = set().union(*(_block_bytes_of(caches[i], o) for i in layers
                                   for o in range(6) if o != b))
            for m in mine:
                assert not m & others, f"block {b} of tensor {t} overlaps another block"
                assert len(m) <= plan.page_bytes


def test_a_recurrent_state_raises_the_attention_block_size_to_hold_it():
    big = RecurrentStateSpec(((40, 3), (4, 16, 16)))  # 1024 + 120 floats: 4576 bytes
    plan, caches = _pool([big, FullAttentionSpec(2, 16)], block_size=4)
    # attention: 2 heads x 16 x 4 bytes = 128 bytes per token per half; the SSM state (4096
    # bytes) fills one half: 32 tokens, a multiple of 4
    assert plan.block_size == 32 and plan.page_bytes == 2 * 128 * 32
    conv, ssm = caches[0]
    assert conv.shape == (6, 40, 3) and ssm.shape == (6, 4, 16, 16)
    ssm[3].fill_(7.0)
    conv[3].fill_(5.0)
    k, v = caches[1][0], caches[1][1]
    assert (k[3] == 7.0).all() and (k[2] == 0).all() and (k[4] == 0).all()
    assert (v[3].flatten()[:120] == 5.0).all() and (v[2] == 0).all()
