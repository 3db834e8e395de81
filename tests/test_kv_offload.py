"""KV offload tiers (kv_offload.*): a prefix evicted from a small pool is served from the host
tier and from the disk tier with the same greedy tokens as recomputing it; the disk tier
survives a restart; a different model never loads another's blocks; caps hold; no leaks."""
from __future__ import annotations

import pytest

from llmkit import LLM
from llmkit.config.errors import ConfigError

# the offload tests' pool, prompts and engines; model and reference are fixtures
from helpers.offload_engines import (BLOCK, assert_no_leak, greedy_tokens, model,  # noqa: F401
                                     offload_llm, reference, two_prompts)


def test_host_tier_serves_an_evicted_prefix(model, reference):
    a, b = two_prompts()
    llm = offload_llm(model, host_gib=0.01)
    conn = llm.engine.kv_connector
    assert greedy_tokens(llm, a) == reference["a"]
    assert greedy_tokens(llm, b) == reference["b"]  # evicts a's blocks: they go to the host tier
    assert conn.stats.saved_blocks > 0 and conn.num_blocks("host") == conn.stats.saved_blocks
    before = llm.engine.kv_cache_manager.prefix_cache_stats.hits
    assert greedy_tokens(llm, a) == reference["a"]
    pool_hits = llm.engine.kv_cache_manager.prefix_cache_stats.hits - before
    host_hits = conn.stats.hits_per_tier.get("host", 0)
    assert host_hits > 0 and conn.stats.loaded_blocks == host_hits // BLOCK
    # the pool's own hit and the host tier's together cover every full block but the last
    assert pool_hits + host_hits == (len(a) - 1) // BLOCK * BLOCK
    assert "disk" not in conn.stats.hits_per_tier
    assert llm.engine.stats().kv_connector.hits_per_tier == {"host": host_hits}
    assert_no_leak(llm)
    llm.shutdown()


def test_without_tiers_the_evicted_prefix_is_recomputed(model, reference):
    a, b = two_prompts()
    llm = offload_llm(model)
    assert llm.engine.kv_connector is None
    for p, key in ((a, "a"), (b, "b"), (a, "a")):
        assert greedy_tokens(llm, p) == reference[key]
    llm.shutdown()


def test_disk_tier_serves_and_survives_a_restart(model, reference, tmp_path):
    a, b = two_prompts()
    disk = tmp_path / "kv"
    llm = offload_llm(model, disk_path=str(disk))
    conn = llm.engine.kv_connector
    greedy_tokens(llm, a)
    greedy_tokens(llm, b)
    assert conn.num_blocks("disk") > 0 and not conn.indexes.get("host")
    assert greedy_tokens(llm, a) == reference["a"]
    assert conn.stats.hits_per_tier.get("disk", 0) > 0
    assert_no_leak(llm)
    llm.shutdown()
    files = list(disk.rglob("*.kv"))
    assert files, "the disk tier wrote no files"

    # A new engine (same model and config) finds them: b was evicted by the third request,
    # so it comes from disk now.
    llm = offload_llm(model, disk_path=str(disk))
    conn = llm.engine.kv_connector
    assert conn.num_blocks("disk") == len(files)
    assert greedy_tokens(llm, b) == reference["b"]
    assert conn.stats.hits_per_tier.get("disk", 0) >= BLOCK
    assert_no_leak(llm)
    llm.shutdown()


def test_a_different_model_never_loads_anothers_blocks(model, tiny_model_dir, tmp_path):
    a, b = two_prompts()
    disk = tmp_path / "kv"
    llm = offload_llm(model, disk_path=str(disk))
    for p in (a, b, a):
        greedy_tokens(llm, p)
    llm.shutdown()
    assert list(disk.rglob("*.kv"))

    other = tiny_model_dir("llama", seed=1)  # same architecture and shapes, other weights
    ref = offload_llm(other, num_blocks=64)
    expected = greedy_tokens(ref, a), greedy_tokens(ref, b)
    ref.shutdown()
    llm = offload_llm(other, disk_path=str(disk))
    conn = llm.engine.kv_connector
    assert conn.num_blocks("disk") == 0
    assert (greedy_tokens(llm, a), greedy_tokens(llm, b)) == expected
    assert not conn.stats.hits_per_tier
    llm.shutdown()


def test_a_tier_keeps_its_cap_lru(model, reference, tmp_path):
    a, b = two_prompts()
    # a block: 2 layers x (K, V) x 4 tokens x 2 KV heads x 16 dims x 4 bytes
    block_nbytes = 2 * 2 * BLOCK * 2 * 16 * 4
    llm = offload_llm(model, host_gib=4 * block_nbytes / (1 << 30))
    conn = llm.engine.kv_connector
    worker = llm.engine.executor.runner.kv_connector  # where the bytes are
    assert conn.block_nbytes == block_nbytes
    cap = conn.indexes["host"].capacity_bytes
    assert cap == 4 * block_nbytes  # room for four blocks
    for p, key in ((a, "a"), (b, "b"), (a, "a"), (b, "b")):
        assert greedy_tokens(llm, p) == reference[key]
        assert conn.indexes["host"].used_bytes <= cap
        assert set(worker.host.blocks) == set(conn.indexes["host"].entries)
        assert conn.num_blocks("host") <= 4
    assert_no_leak(llm)
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
    from llmkit.engine.loop.components import validate_components

    with pytest.raises(ConfigError, match="speculative=eagle"):
        validate_components(build_config(overrides=[
            "kv_offload.host_gib=0.01", "speculative=eagle", "speculative.model=x"]))
    with pytest.raises(ConfigError, match="kv_offload.disk_path"):
        validate_components(build_config(overrides=[
            f"kv_offload.disk_path={tmp_path}", "lora.enabled=true"]))
