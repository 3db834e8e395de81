"""KV offload tiers (kv_offload.*): a prefix evicted from a small pool is served from the host
tier and from the disk tier with the same greedy tokens as recomputing it; the disk tier
survives a restart; a different model never loads another's blocks; caps hold; no leaks."""
from __future__ import annotations

import random

import pytest

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError

BLOCK = 4
SMALL_POOL = 12  # blocks: one 30-token prompt (8 blocks) fits, two do not
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts(seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return ([rng.randrange(5, 600) for _ in range(30)],
            [rng.randrange(5, 600) for _ in range(30)])


def _llm(model_dir, num_blocks: int = SMALL_POOL, **offload) -> LLM:
    groups = {"kv_offload": offload} if offload else {}
    return LLM(str(model_dir), dtype="float32", attention="torch",
               kv_cache={"num_blocks": num_blocks, "block_size": BLOCK}, **groups)


def _gen(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks still held after every request ended"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens computed from scratch in a pool large enough to need no eviction."""
    a, b = _prompts()
    llm = _llm(model, num_blocks=64)
    out = {"a": _gen(llm, a), "b": _gen(llm, b)}
    llm.shutdown()
    return out


def test_host_tier_serves_an_evicted_prefix(model, reference):
    a, b = _prompts()
    llm = _llm(model, host_gib=0.01)
    conn = llm.engine.kv_connector
    assert _gen(llm, a) == reference["a"]
    assert _gen(llm, b) == reference["b"]  # evicts a's blocks: they go to the host tier
    assert conn.stats.saved_blocks > 0 and conn.num_blocks("host") == conn.stats.saved_blocks
    before = llm.engine.kv_cache_manager.prefix_cache_stats.hits
    assert _gen(llm, a) == reference["a"]
    pool_hits = llm.engine.kv_cache_manager.prefix_cache_stats.hits - before
    host_hits = conn.stats.hits_per_tier.get("host", 0)
    assert host_hits > 0 and conn.stats.loaded_blocks == host_hits // BLOCK
    # the pool's own hit and the host tier's together cover every full block but the last
    assert pool_hits + host_hits == (len(a) - 1) // BLOCK * BLOCK
    assert "disk" not in conn.stats.hits_per_tier
    assert llm.engine.stats().kv_connector.hits_per_tier == {"host": host_hits}
    _assert_no_leak(llm)
    llm.shutdown()


def test_without_tiers_the_evicted_prefix_is_recomputed(model, reference):
    a, b = _prompts()
    llm = _llm(model)
    assert llm.engine.kv_connector is None
    for p, key in ((a, "a"), (b, "b"), (a, "a")):
        assert _gen(llm, p) == reference[key]
    llm.shutdown()


def test_disk_tier_serves_and_survives_a_restart(model, reference, tmp_path):
    a, b = _prompts()
    disk = tmp_path / "kv"
    llm = _llm(model, disk_path=str(disk))
    conn = llm.engine.kv_connector
    _gen(llm, a)
    _gen(llm, b)
    assert conn.num_blocks("disk") > 0 and not conn.indexes.get("host")
    assert _gen(llm, a) == reference["a"]
    assert conn.stats.hits_per_tier.get("disk", 0) > 0
    _assert_no_leak(llm)
    llm.shutdown()
    files = list(disk.rglob("*.kv"))
    assert files, "the disk tier wrote no files"

    # A new engine (same model and config) finds them: b was evicted by the third request,
    # so it comes from disk now.
    llm = _llm(model, disk_path=str(disk))
    conn = llm.engine.kv_connector
    assert conn.num_blocks("disk") == len(files)
    assert _gen(llm, b) == reference["b"]
    assert conn.stats.hits_per_tier.get("disk", 0) >= BLOCK
    _assert_no_leak(llm)
    llm.shutdown()


def test_a_different_model_never_loads_anothers_blocks(model, tiny_model_dir, tmp_path):
    a, b = _prompts()
    disk = tmp_path / "kv"
    llm = _llm(model, disk_path=str(disk))
    for p in (a, b, a):
        _gen(llm, p)
    llm.shutdown()
    assert list(disk.rglob("*.kv"))

    other = tiny_model_dir("llama", seed=1)  # same architecture and shapes, other weights
    ref = _llm(other, num_blocks=64)
    expected = _gen(ref, a), _gen(ref, b)
    ref.shutdown()
    llm = _llm(other, disk_path=str(disk))
    conn = llm.engine.kv_connector
    assert conn.num_blocks("disk") == 0
    assert (_gen(llm, a), _gen(llm, b)) == expected
    assert not conn.stats.hits_per_tier
    llm.shutdown()


def test_a_tier_keeps_its_cap_lru(model, reference, tmp_path):
    a, b = _prompts()
    # a block: 2 layers x (K, V) x 4 tokens x 2 KV heads x 16 dims x 4 bytes
    block_nbytes = 2 * 2 * BLOCK * 2 * 16 * 4
    llm = _llm(model, host_gib=4 * block_nbytes / (1 << 30))
    conn = llm.engine.kv_connector
    worker = llm.engine.executor.runner.kv_connector  # where the bytes are
    assert conn.block_nbytes == block_nbytes
    cap = conn.indexes["host"].capacity_bytes
    assert cap == 4 * block_nbytes  # room for four blocks
    for p, key in ((a, "a"), (b, "b"), (a, "a"), (b, "b")):
        assert _gen(llm, p) == reference[key]
        assert conn.indexes["host"].used_bytes <= cap
        assert set(worker.host.blocks) == set(conn.indexes["host"].entries)
        assert conn.num_blocks("host") <= 4
    _assert_no_leak(llm)
    llm.shutdown()


def test_config_errors_name_the_key(model):
    with pytest.raises(ConfigError, match="kv_offload.host_gib.*enable_prefix_caching"):
        LLM(str(model), dtype="float32", kv_offload={"host_gib": 1.0},
            kv_cache={"enable_prefix_caching": False})
    with pytest.raises(ConfigError, match="kv_offload.host_gib"):
        LLM(str(model), dtype="float32", kv_offload={"host_gib": -1})


def test_connector_combinations_refused_at_start(tmp_path):
    """EAGLE with a connector, and a disk tier with LoRA adapters, fail at start-up naming
    the key rather than serving another request's (or adapter's) KV."""
    from llmkit.config import build_config
    from llmkit.config.errors import ConfigError
    from llmkit.engine.components import validate_components

    with pytest.raises(ConfigError, match="speculative=eagle"):
        validate_components(build_config(overrides=[
            "kv_offload.host_gib=0.01", "speculative=eagle", "speculative.model=x"]))
    with pytest.raises(ConfigError, match="kv_offload.disk_path"):
        validate_components(build_config(overrides=[
            f"kv_offload.disk_path={tmp_path}", "lora.enabled=true"]))
