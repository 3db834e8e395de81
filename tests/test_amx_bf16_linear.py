"""The amx tier's bf16 tile linear (kernels/cpu/amx_bf16_linear.h): against a float32 reference,
a row's bits at every batch size, and the platform routing bf16 layers of the amx tier to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit.config.cpu_isa import supported_tiers
from llmkit.config.schema import PlatformConfig
from llmkit.linear.base import LinearSpec
from llmkit.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.skipif("amx" not in supported_tiers(),
                                reason="needs a CPU (and kernel) with AMX tiles")


@pytest.fixture(scope="module")
def ops():
    from llmkit.kernels.cpu_native import load_cpu_kernels

    return load_cpu_kernels("amx")


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# 579 outputs: an odd last block of 16 and a partial one; 100 inputs: a zero-padded block of 32
@pytest.mark.parametrize("out_features,in_features", [(579, 576), (600, 100), (16, 32)])
def test_tile_linear_matches_float32_products(ops, out_features, in_features):
    w, b = randn(out_features, in_features, seed=1), randn(out_features, seed=2)
    x = randn(37, in_features, seed=3)
    got = ops.bf16_tile_linear(x, ops.bf16_tile_pack(w), out_features, b)
    want = F.linear(x.float(), w.float(), b.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # bf16 products summed in float32 (another order), rounded once: within a bf16 step
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


def test_tile_linear_row_bits_do_not_depend_on_the_batch(ops):
    """Each output is one tile element summed over the input blocks in order, from its own row:
    the same bits alone, in a tile of 16, in a padded tile, or among 300 rows."""
    w, b = randn(579, 576, seed=4), randn(579, seed=5)
    packed = ops.bf16_tile_pack(w)
    x = randn(300, 576, seed=6)
    full = ops.bf16_tile_linear(x, packed, 579, b)
    for begin, end in [(0, 1), (7, 8), (0, 2), (0, 15), (10, 13), (5, 21), (16, 48), (1, 64),
                       (299, 300), (3, 260)]:
        assert torch.equal(ops.bf16_tile_linear(x[begin:end], packed, 579, b), full[begin:end])


def test_amx_tier_routes_bf16_layers_to_the_tiles():
    from llmkit.models.layers.linear import Linear

    spec = LinearSpec("x", 576, (579,), dtype=torch.bfloat16)
    factory = CpuPlatform(PlatformConfig(name="cpu", isa="amx")).linear_method_factory(
        torch.bfloat16)
    layer = Linear.build("x", 576, 579, bias=True, dtype=torch.bfloat16,
                         linear_method=factory)
    layer.load_weight("weight", randn(579, 576, seed=7))
    layer.load_weight("bias", randn(579, seed=8))
    layer.process_weights_after_loading()
    method = layer.method
    assert method.tile_weight is not None and method.packed_weight is None
    x = randn(600, 576, seed=9)
    tiles = method.kernels.bf16_tile_linear(x[:64], method.tile_weight, 579, layer.bias)
    for rows in (1, 8, 64):  # the decode rows: the tiles, whatever the batch
        assert torch.equal(layer(x[:rows]), tiles[:rows])
    # past linear_packed_max_rows (prefill): oneDNN's GEMM on the plain weight
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "amx-bf16" in method.describe()
    other = CpuPlatform(PlatformConfig(name="cpu", isa="avx512_bf16"))
    assert not other.linear_method_factory(torch.bfloat16)(spec).bf16_tiles
