"""The C++ kernels' own threads (``kernels/cpu/thread_pool.h``): the pool computes the bits that
torch's OpenMP threads compute (each chunk is the same range whichever thread runs it), from
one caller, several callers at once and a forked child, and its idle threads go to sleep
(a waiting thread must not hold a core that another process wants)."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from llmkit.config.cpu_dispatch import CpuDispatch
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.kernels.quant import weights

from helpers import gguf_rows

SPIN_US = CpuDispatch().thread_pool_spin_us


@pytest.fixture(scope="module")
def ops():
    ops = load_cpu_kernels()
    ops.set_thread_pool_spin_us(SPIN_US)  # whatever an earlier test's platform left there
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two threads even on a one-core runner: the pool must split
    yield ops
    ops.set_thread_pool_spin_us(SPIN_US)
    torch.set_num_threads(threads)


def _inputs():
    g = torch.Generator().manual_seed(0)
    k, n = 576, 1536  # big enough that every kernel below splits over both threads
    packed = weights.pack_gguf(gguf_rows.random_gguf_rows("q4_1", n, k, seed=1), "q4_1", k)
    x = torch.randn(3, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    blocks, block_size, heads, kv_heads, d = 24, 16, 9, 3, 64
    cache = torch.randn(2, blocks, block_size, kv_heads, d, generator=g).to(torch.bfloat16)
    q = torch.randn(1, heads, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=g)[:16][None].to(torch.int32)
    return packed, x, w, (q, cache, table, torch.tensor([200]))


def _run(ops, inputs) -> list[torch.Tensor]:
    packed, x, w, (q, cache, table, lens) = inputs
    def quant_linear(rows):  # this tier's op (weights.quant_linear takes any loaded tier's)
        return ops.quant_linear(rows, packed.data, packed.format, packed.out_features,
                                packed.scales, None, False, False)

    return [quant_linear(x[:1]), quant_linear(x), ops.linear(x[:1].to(torch.bfloat16), w, None),
            ops.paged_decode_attention(q, cache, table, lens, 0.125)]


def _pool_threads() -> dict[int, str]:
    """State (``/proc``'s letter) of each of this process's kernel-pool threads, by id."""
    states = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile is not listed
            if (task / "comm").read_text().strip() == "llmkit-kernels":
                states[int(task.name)] = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return states


def test_the_pool_computes_the_bits_of_torch_threads(ops):
    inputs = _inputs()
    ops.set_thread_pool_spin_us(0)  # at::parallel_for on torch's OpenMP threads
    reference = _run(ops, inputs)
    ops.set_thread_pool_spin_us(SPIN_US)
    assert ops.thread_pool_spin_us() == SPIN_US
    for _ in range(20):
        for out, ref in zip(_run(ops, inputs), reference):
            assert torch.equal(out, ref)
    assert _pool_threads(), "the kernels ran without their pool"


def test_several_callers_at_once_get_their_bits(ops):
    inputs = _inputs()
    reference = _run(ops, inputs)
    failures: list[str] = []

    def caller() -> None:
        for _ in range(30):
            if not all(torch.equal(a, b) for a, b in zip(_run(ops, inputs), reference)):
                failures.append("wrong bits")

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not failures


def test_idle_pool_threads_sleep(ops):
    _run(ops, _inputs())
    assert _pool_threads()
    deadline = time.monotonic() + 5.0  # the spin is milliseconds; a loaded runner is slower
    while time.monotonic() < deadline:
        if set(_pool_threads().values()) == {"S"}:
            return
        time.sleep(0.05)
    pytest.fail(f"kernel pool threads still running when idle: {_pool_threads()}")


def test_a_forked_child_gets_a_pool_of_its_own(ops):
    inputs = _inputs()
    reference = _run(ops, inputs)  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers are not here
        code = 3  # an exception
        try:
            torch.set_num_threads(2)
            code = 1 if not all(torch.equal(a, b) for a, b in zip(_run(ops, inputs), reference)) \
                else 2 if not _pool_threads() else 0  # 2: no threads of its own split the work
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            assert code == 0, {1: "wrong bits", 2: "no pool threads", 3: "an exception"}.get(code)
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in a kernel")
