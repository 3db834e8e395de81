"""The CPU dispatch table (``llmkit.config.cpu_dispatch``): its defaults per instruction-set tier
are pinned, ``platform.dispatch`` overrides reach every component the platform builds, bad
values are config errors naming the key, and ``llmkit config`` shows the resolved table."""
from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from llmkit.attention import attention_backend_class
from llmkit.attention.cpu_backend import CpuAttentionBackend
from llmkit.config.cpu_dispatch import (TIER_DEFAULTS, CpuDispatch, dispatch_for_tier,
                                        resolve_dispatch)
from llmkit.config.cpu_isa import TIER_NAMES
from llmkit.config.errors import ConfigError
from llmkit.config.schema import (AttentionConfig, CompilationConfig, CpuDispatchConfig,
                                  PlatformConfig)
from llmkit.entrypoints.cli import main
from llmkit.executor.parallel_checks import max_ranks
from llmkit.lora.punica import CpuLoRAOps, lora_ops_for
from llmkit.platforms import CpuPlatform
from llmkit.sampling import topk_topp
from llmkit.sampling.sampler import SamplingMetadata, TorchSampler

REPO = Path(__file__).resolve().parents[1]

# Today's values, measured on the project's 2-core AVX2 machine, are every tier's defaults.
MEASURED = dict(linear_small_batch_max_rows=8, linear_packed_max_rows=512,
                lora_small_batch_max_rows=2048, attention_min_compiled_decode_rows=8,
                attention_max_expanded_query_len=16, step_graph_max_rows=256,
                top_p_candidates=256, ranks_per_core=2, linear_prefetch_bytes=2048,
                linear_thread_min_bytes=8192, thread_pool_spin_us=2000)

OVERRIDES = dict(linear_small_batch_max_rows=4, linear_packed_max_rows=64,
                 lora_small_batch_max_rows=32, attention_min_compiled_decode_rows=3,
                 attention_max_expanded_query_len=5, step_graph_max_rows=2,
                 top_p_candidates=100, ranks_per_core=1, linear_prefetch_bytes=0,
                 linear_thread_min_bytes=0, thread_pool_spin_us=0)


@pytest.mark.parametrize("tier", [*TIER_NAMES, None])
def test_defaults_per_tier_are_pinned(tier):
    assert asdict(dispatch_for_tier(tier)) == MEASURED
    assert asdict(resolve_dispatch(tier)) == MEASURED
    assert set(TIER_DEFAULTS) == {*TIER_NAMES, None}


def test_config_section_and_yaml_list_every_field():
    names = [f.name for f in fields(CpuDispatch)]
    assert list(CpuDispatchConfig.model_fields) == names
    for path in sorted((REPO / "conf" / "platform").glob("*.yaml")):
        section = yaml.safe_load(path.read_text())["dispatch"]
        assert section == dict.fromkeys(names), path.name


def _platform(**dispatch) -> CpuPlatform:
    return CpuPlatform(PlatformConfig(name="cpu", native_kernels="off", dispatch=dispatch))


def test_overrides_reach_every_component(monkeypatch):
    platform = _platform(**OVERRIDES)
    assert asdict(platform.dispatch) == OVERRIDES

    linear = platform.linear_method_factory(torch.float32)(None)
    assert (linear.small_batch_max_rows, linear.packed_max_rows) == (4, 64)

    fake_kernels = SimpleNamespace(lora_add_=None)
    lora = lora_ops_for(torch.device("cpu"), fake_kernels, platform.dispatch)
    assert isinstance(lora, CpuLoRAOps) and lora.small_batch_max_rows == 32

    attn = attention_backend_class(AttentionConfig(name="auto"), platform).for_platform(platform)
    assert isinstance(attn, CpuAttentionBackend)
    assert (attn.min_compiled_decode_rows, attn.max_expanded_query_len) == (3, 5)

    sampler = TorchSampler.for_platform(platform, seed=3)
    assert (sampler.seed, sampler.top_p_candidates) == (3, 100)
    seen = []
    real = topk_topp.apply_top_k_top_p

    def spy(logits, top_k, top_p, candidates=None):
        seen.append(candidates)
        return real(logits, top_k, top_p, candidates)

    monkeypatch.setattr(topk_topp, "apply_top_k_top_p", spy)
    meta = SamplingMetadata(temperature=torch.ones(2), all_greedy=False,
                            top_p=torch.full((2,), 0.9))
    sampler(torch.randn(2, 300), meta)
    assert seen == [100]

    limit, why = max_ranks(platform)
    assert why.startswith("1 per usable CPU core")

    import llmkit.compilation.inductor as inductor

    captured = {}
    monkeypatch.setattr(inductor, "InductorStepGraphs",
                        lambda model, caches, rows, **kw: captured.setdefault("rows", rows))
    model = torch.nn.Module()
    model.attn_backend = SimpleNamespace(supports_step_graphs=True)
    platform.step_graphs(model, [], CompilationConfig(mode="graphs"), max_num_seqs=64)
    assert captured["rows"] == 2


def test_components_alone_take_the_defaults():
    assert CpuAttentionBackend().max_expanded_query_len == 16
    assert CpuLoRAOps(None).small_batch_max_rows == 2048
    assert TorchSampler.for_platform(SimpleNamespace(dispatch=None)).top_p_candidates is None
    linear = _platform().linear_method_factory(torch.float32)(None)
    assert (linear.small_batch_max_rows, linear.packed_max_rows) == (8, 512)


def _model(*methods, head=None) -> torch.nn.Module:
    """A model whose linear layers hold ``methods`` (and ``head``, its LM head)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for method in methods:
        layer = torch.nn.Module()
        layer.method = method
        model.layers.append(layer)
    if head is not None:
        model.lm_head = torch.nn.Module()
        model.lm_head.method = head
    return model


def test_step_graph_rows_follow_what_the_linears_hold():
    """Graphs stop where a layer's path switches: the C++ float linear's rows (raising them
    raises the graphs'), any count for quantized layers (up to the ceiling and max_num_seqs),
    the LoRA kernel's rows; a method that does not say keeps the linear's rows."""
    from llmkit.linear.base import LinearMethod
    from llmkit.linear.quantized import QuantizedLinearMethod
    from llmkit.lora.layers import LoRALinearMethod

    fake = SimpleNamespace(quant_linear=None)
    for small, ceiling, seqs in ((8, None, 256), (16, None, 256), (16, 4, 256), (8, None, 6)):
        platform = _platform(linear_small_batch_max_rows=small, step_graph_max_rows=ceiling)

        def float_method():
            method = platform.linear_method_factory(torch.float32)(None)
            method.kernels = fake  # as with the C++ kernels loaded
            return method

        def quantized(use_float=False):
            method = QuantizedLinearMethod("gguf", float_method(), fake)
            method.use_float = use_float
            return method

        top = min(ceiling or 256, seqs)
        assert platform.graph_rows(_model(float_method(), float_method()), seqs) == \
            min(small, top)
        assert platform.graph_rows(_model(quantized(), quantized()), seqs) == top
        # one layer left in float holds the graphs to the C++ linear's rows
        assert platform.graph_rows(_model(quantized(), quantized(True)), seqs) == \
            min(small, top)
        # the LM head runs outside the graph
        assert platform.graph_rows(_model(quantized(), head=float_method()), seqs) == top

        class Plain(LinearMethod):
            def apply(self, layer, x):
                return x

        assert platform.graph_rows(_model(quantized(), Plain()), seqs) == min(small, top)
    lora = LoRALinearMethod.__new__(LoRALinearMethod)
    lora.base, lora.ops = quantized(), SimpleNamespace(small_batch_max_rows=32)
    assert _platform().graph_rows(_model(lora), 256) == 32
    # amx tier: bf16 layers on the AMX tiles keep one kernel up to linear_packed_max_rows
    platform = _platform(linear_packed_max_rows=64)
    tiles = platform.linear_method_factory(torch.bfloat16)(None)
    tiles.kernels, tiles.tile_weight = fake, torch.empty(1)
    assert platform.graph_rows(_model(tiles), 256) == 64


@pytest.mark.parametrize("override,expected", [
    ("platform.dispatch.linear_packed_max_rows=-1",
     "platform.dispatch.linear_packed_max_rows: got -1; allowed: an integer >= 0"),
    ("platform.dispatch.top_p_candidates=0",
     "platform.dispatch.top_p_candidates: got 0; allowed: an integer >= 1"),
    ("platform.dispatch.step_graph_max_rows=0",
     "platform.dispatch.step_graph_max_rows: got 0; allowed: an integer >= 1"),
])
def test_a_bad_value_is_a_config_error_naming_the_key(capsys, override, expected):
    assert main(["config", override]) != 0
    assert expected in capsys.readouterr().err


def test_llmkit_config_shows_the_resolved_table(capsys):
    assert main(["config", "platform=cpu", "platform.dispatch.lora_small_batch_max_rows=64"]) == 0
    out = capsys.readouterr().out
    assert "# CPU dispatch (tier " in out
    assert "lora_small_batch_max_rows=64" in out and "linear_small_batch_max_rows=8" in out
    assert "step graphs cover decode steps of up to: quantized linears 256" in \
        " ".join(out.replace("#", " ").split())
    assert main(["config", "platform=cpu", "scheduler.max_num_seqs=64"]) == 0
    out = " ".join(capsys.readouterr().out.replace("#", " ").split())
    assert "quantized linears 64 (step_graph_max_rows, scheduler.max_num_seqs); float/bf16 " \
        "linears 8 (linear_small_batch_max_rows)" in out
    assert main(["config", "platform=cuda"]) == 0  # no CPU table for another platform
    assert "# CPU dispatch" not in capsys.readouterr().out
