"""The offload tiers under trouble (issue 24): a disk-tier file that vanished, was truncated or
rotted between lookup and load is a miss (the request recomputes, with the same tokens, and
``failed_loads`` counts it), never a crash or garbage; a disk that does not keep up never
stalls steps (writes are write-behind); the host tier's lossless compression round-trips and
still hits."""
from __future__ import annotations

import threading

import pytest
import torch

from llmkit import LLM
from llmkit.config.errors import ConfigError
from llmkit.kv_transfer.compression import BlockCodec

# the offload tests' pool, prompts and engines; model and reference are fixtures
from helpers.offload_engines import (assert_no_leak, greedy_tokens, model,  # noqa: F401
                                     offload_llm, reference, two_prompts)


def _damage(path, how: str) -> None:
    if how == "vanish":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    else:  # one payload byte flipped: header and size still right, the checksum is not
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x40
        path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["vanish", "truncate", "corrupt"])
def test_a_damaged_disk_file_is_a_miss_and_recomputes(model, reference, tmp_path, how):
    a, b = two_prompts()
    llm = offload_llm(model, disk_path=str(tmp_path / "kv"))
    conn = llm.engine.kv_connector
    worker = llm.engine.executor.runner.kv_connector
    greedy_tokens(llm, a)
    assert greedy_tokens(llm, b) == reference["b"]  # a's blocks go to disk
    worker.disk.flush()
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert files and conn.num_blocks("disk") == len(files)
    for f in files:  # every file: whichever a's lookup reaches first is damaged
        _damage(f, how)
    assert greedy_tokens(llm, a) == reference["a"]  # recomputed, not crashed, not garbage
    stats = conn.stats
    assert stats.failed_loads == 1 and "disk" not in stats.hits_per_tier
    assert llm.engine.stats().kv_connector.failed_loads == 1
    assert_no_leak(llm)
    # The failed blocks are forgotten: a's next miss does not try them again.
    assert greedy_tokens(llm, b) == reference["b"]
    assert llm.engine.kv_connector.stats.failed_loads == 1
    assert_no_leak(llm)
    llm.shutdown()


def test_a_slow_disk_does_not_stall_steps(model, reference, tmp_path):
    """Every disk write is held back until the end: the engine still serves (evicting to
    disk, and loading from it: the queued blocks), and the files appear once released."""
    a, b = two_prompts()
    llm = offload_llm(model, disk_path=str(tmp_path / "kv"))
    conn = llm.engine.kv_connector
    disk = llm.engine.executor.runner.kv_connector.disk
    gate = threading.Event()
    real_write = disk._write

    def slow_write(*args):
        gate.wait(timeout=60)
        real_write(*args)

    disk._write = slow_write
    try:
        for p, key in ((a, "a"), (b, "b"), (a, "a")):
            assert greedy_tokens(llm, p) == reference[key]
        assert conn.stats.hits_per_tier.get("disk", 0) > 0  # served from the write queue
        assert not list((tmp_path / "kv").rglob("*.kv")), "a write was not held back"
    finally:
        gate.set()
    disk.flush()
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == conn.num_blocks("disk") > 0
    assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", ["zlib", "zstd"])
def test_codecs_round_trip_exactly(codec, dtype):
    c = BlockCodec(codec)
    x = (torch.randn(2, 2, 4, 2, 16) * 3).to(dtype)
    enc = c.encode(x)
    y = c.decode(enc)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))  # bit for bit
    # small integers: their mantissas' low bytes are zeros, which the shuffle lines up
    z = torch.randint(-8, 8, (2, 2, 4, 2, 16)).to(dtype)
    enc = c.encode(z)
    assert torch.equal(c.decode(enc), z)
    assert c.nbytes(enc) < z.numel() * z.element_size() // 2


@pytest.mark.parametrize("codec", ["zlib", "zstd"])
def test_compressed_host_tier_hits_with_the_same_tokens(model, reference, codec):
    a, b = two_prompts()
    llm = offload_llm(model, host_gib=0.01, host_compression=codec)
    conn = llm.engine.kv_connector
    for p, key in ((a, "a"), (b, "b"), (a, "a")):
        assert greedy_tokens(llm, p) == reference[key]
    assert conn.stats.hits_per_tier.get("host", 0) > 0
    host = conn.indexes["host"]
    # the cap counts what the blocks take compressed
    assert 0 < host.used_bytes < len(host) * conn.block_nbytes
    assert_no_leak(llm)
    llm.shutdown()


def test_compression_config_errors_name_the_key(model):
    with pytest.raises(ConfigError, match="kv_offload.host_compression.*host_gib"):
        LLM(str(model), dtype="float32", kv_offload={"disk_path": "/tmp/x",
                                                     "host_compression": "zlib"})
    with pytest.raises(ConfigError, match="kv_offload.host_compression"):
        LLM(str(model), dtype="float32", kv_offload={"host_gib": 0.01,
                                                     "host_compression": "lzma"})
