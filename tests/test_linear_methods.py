"""Linear methods (llmkit/linear/): the CPU method's three paths against F.linear, bf16 computed
in float32, the platform's choice per layer, and a method named by config taking effect."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit import LLM, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.config.schema import PlatformConfig
from llmkit.kernels.cpu_native import load_cpu_kernels
from llmkit.linear.base import LinearSpec
from llmkit.linear.cpu_linear import CpuLinearMethod
from llmkit.linear.torch_linear import TorchLinearMethod
from llmkit.models.layers.linear import Linear, MergedLinear
from llmkit.platforms.cpu import CpuPlatform, has_native_bf16


def make_layer(method, dtype=torch.float32, out=80, inp=96, seed=0) -> Linear:
    layer = Linear.build("test", inp, out, bias=True, dtype=dtype, linear_method=lambda s: method)
    g = torch.Generator().manual_seed(seed)
    layer.load_weight("weight", torch.randn(out, inp, generator=g).to(dtype))
    layer.load_weight("bias", torch.randn(out, generator=g).to(dtype))
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 9, 64, 600])  # C++ <= 8 < packed <= 512 < MKL
def test_cpu_method_matches_f_linear(rows, kernels):
    layer = make_layer(CpuLinearMethod(load_cpu_kernels() if kernels else None))
    assert layer.method.packed_weight is not None
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5,
                               atol=1e-4)


def test_bfloat16_in_float32_matches_bfloat16_gemm():
    """A bf16 layer computed in float32 (CPUs without native bf16): same products, float32
    accumulation, bf16 output, so it equals torch's bf16 GEMM up to summation order. One row
    goes through torch's bf16 GEMV on the bf16 weight itself: exactly torch's bf16 result."""
    layer = make_layer(CpuLinearMethod(None, widen_bf16=True), torch.bfloat16)
    method = layer.method
    assert layer.weight.dtype == torch.bfloat16 and method.widen_bf16
    assert method.weight_float32.dtype == torch.float32
    w, b = layer.weight.detach(), layer.bias.detach()
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 64, 600):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        want = F.linear(x, w, b)
        exact = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
        got = layer(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, exact, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
        if rows == 1:
            assert torch.equal(got, want)


@pytest.mark.skipif(not has_native_bf16(), reason="oneDNN packs bf16 only with native bf16")
def test_bfloat16_packed_weight_gives_f_linears_bits():
    """Where the tier computes bf16 natively, bf16 layers past the C++ linear's rows run oneDNN
    on a copy packed once instead of the plain weight that oneDNN reorders on every call: the
    same kernel on the same blocks, so F.linear's bits."""
    layer = make_layer(CpuLinearMethod(load_cpu_kernels(), pack_bf16=True), torch.bfloat16,
                       out=600, inp=576)
    assert layer.method.packed_weight is not None and not layer.method.widen_bf16
    g = torch.Generator().manual_seed(2)
    for rows in (9, 64, 200):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_merged_layer_loads_each_shard_into_its_rows():
    layer = MergedLinear("qkv", 8, {"q": 4, "k": 2, "v": 2}, bias=False, dtype=torch.float32,
                         linear_method=lambda s: TorchLinearMethod())
    parts = {s: torch.full((n, 8), float(i)) for i, (s, n) in enumerate({"q": 4, "k": 2,
                                                                          "v": 2}.items())}
    for shard, w in parts.items():
        layer.load_weight("weight", w, shard)
    assert torch.equal(layer.weight, torch.cat(list(parts.values())))
    assert layer.expected_weights() == {("weight", s) for s in "qkv"}
    with pytest.raises(ValueError, match="checkpoint shape"):
        layer.load_weight("weight", torch.zeros(3, 8), "q")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_platform_picks_its_method_per_layer(dtype):
    spec = LinearSpec("x", 64, (32,), dtype=dtype)
    method = CpuPlatform(PlatformConfig(name="cpu")).linear_method_factory(dtype)(spec)
    assert isinstance(method, CpuLinearMethod) and method.kernels is not None
    assert method.widen_bf16 == (dtype == torch.bfloat16 and not has_native_bf16())
    assert method.pack_bf16 == (dtype == torch.bfloat16 and has_native_bf16())
    off = CpuPlatform(PlatformConfig(name="cpu", native_kernels="off", packed_linear=False))
    plain = off.linear_method_factory(dtype)(spec)
    assert plain.kernels is None and not plain.pack and not plain.widen_bf16


class ScaledLinearMethod(TorchLinearMethod):
    """A third-party method for the config test: F.linear times 0 on the LM head (every logit
    0: greedy picks token 0), counting calls."""

    calls = 0

    def create_weights(self, layer, spec):
        super().create_weights(layer, spec)
        self.is_head = spec.prefix == "lm_head"

    def apply(self, layer, x):
        type(self).calls += 1
        y = F.linear(x, layer.weight, layer.bias)
        return y * 0 if self.is_head else y


def test_linear_method_by_class_path_takes_effect(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    base = LLM(path, dtype="float32").generate([[5, 6, 7]], params, use_tqdm=False)
    ScaledLinearMethod.calls = 0
    llm = LLM(path, dtype="float32",
              overrides=["model.linear_method=test_linear_methods.ScaledLinearMethod"])
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == [0, 0, 0, 0] != base[0].outputs[0].token_ids
    assert ScaledLinearMethod.calls > 0
    layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.method, ScaledLinearMethod) for m in layers)


def test_unknown_linear_method_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="model.linear_method"):
        LLM(str(tiny_model_dir("llama")), overrides=["model.linear_method=nope"])
