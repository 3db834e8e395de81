"""Multi-LoRA (llmkit/lora/): greedy tokens against Hugging Face + PEFT with the adapter merged
(``merge_and_unload``), adapters and base rows mixed in one batch, more adapters than slots,
prefix caching per adapter, adapter files that must be refused, the scheduler's slot rule and
its starvation bound, and the batched LoRA ops (torch groups, the C++ kernel, Triton under
``TRITON_INTERPRET=1``) against one reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.lora_adapters import ALL_LINEAR, build_adapter, hf_greedy, merged_model

from llmkit import LLM, LoRARequest, SamplingParams
from llmkit.config.errors import ConfigError
from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.lora.base import LoRALoadError, RowSlots
from llmkit.lora.punica import CpuLoRAOps, StackedLoRA, TorchLoRAOps, TritonLoRAOps
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request
from llmkit.scheduler.token_budget import TokenBudgetScheduler

MAX_TOKENS = 10
PROMPTS = ["The quick brown fox jumps over", "Hello, how are you today?",
           "Once upon a time there was a little robot", "What is the capital of France?"]


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def lora_llm(model_dir: Path, **lora) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 256},
               scheduler={"max_num_seqs": 16},
               lora={"enabled": True, "max_loras": 2, "max_lora_rank": 16, **lora})


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Per arch, two random non-zero adapters of different ranks: rank 8 (alpha 16) and rank
    16 with rsLoRA and a per-module alpha; on llama (untied embeddings) the second also
    adapts the embedding and the LM head."""
    out = {}
    for arch in ("llama", "qwen2"):
        model_dir = tiny_model_dir(arch)
        root = tmp_path_factory.mktemp(f"lora-{arch}")
        extra = ("embed_tokens", "lm_head") if arch == "llama" else ()
        a = build_adapter(model_dir, root / "r8", r=8, lora_alpha=16, seed=1)
        b = build_adapter(model_dir, root / "r16", r=16, lora_alpha=8, seed=2, use_rslora=True,
                          alpha_pattern={"down_proj": 24},
                          target_modules=ALL_LINEAR + extra)
        out[arch] = (model_dir, a, b)
    return out


# ------------------------------------------------------------------ the reference: HF + PEFT

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_peft_merged(arch, adapters):
    model_dir, r8, r16 = adapters[arch]
    llm = lora_llm(model_dir)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    loras = [None, LoRARequest("r8", 1, str(r8)), LoRARequest("r16", 2, str(r16))]
    # Every prompt under every adapter (and the base) in one batch of 9 requests.
    batch = [(p, lr) for lr in loras for p in prompts]
    outs = llm.generate([p for p, _ in batch], greedy(), lora_request=[lr for _, lr in batch],
                        use_tqdm=False)
    got = {(tuple(p), lr and lr.lora_name): o.outputs[0].token_ids
           for (p, lr), o in zip(batch, outs)}
    for lr, path in zip(loras, (None, r8, r16)):
        ref = merged_model(model_dir, path)
        for p in prompts:
            assert got[(tuple(p), lr and lr.lora_name)] == hf_greedy(ref, p, MAX_TOKENS), \
                (arch, lr, p)
    for p in prompts:  # the adapters change the output (the comparison above can fail)
        assert got[(tuple(p), "r8")] != got[(tuple(p), None)]
        assert got[(tuple(p), "r16")] != got[(tuple(p), None)]
    manager = llm.engine.executor.runner.lora_manager
    assert sorted(manager.resident_ids) == [1, 2] and manager.num_loads == 2
    llm.shutdown()


def test_mixed_batch_equals_each_alone(adapters, tmp_path):
    """Three adapters and base requests in one batch (every step mixes them) give each
    request the tokens it gets alone; steps decoding <= 8 rows take the C++ kernel."""
    model_dir, r8, r16 = adapters["llama"]
    r8b = build_adapter(model_dir, tmp_path / "r8b", r=8, lora_alpha=8, seed=3,
                        target_modules=("q_proj", "v_proj", "down_proj"))
    loras = [LoRARequest("a", 1, str(r8)), LoRARequest("b", 2, str(r16)),
             LoRARequest("c", 3, str(r8b)), None]
    llm = lora_llm(model_dir, max_loras=3)
    tok = llm.get_tokenizer()
    batch = [(tok.encode(p), loras[i % 4]) for i, p in enumerate(PROMPTS + PROMPTS[::-1])]
    mixed = llm.generate([p for p, _ in batch], greedy(), lora_request=[lr for _, lr in batch],
                         use_tqdm=False)
    for (p, lr), out in zip(batch, mixed):
        alone = llm.generate([p], greedy(), lora_request=lr, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, lr
    manager = llm.engine.executor.runner.lora_manager
    assert sorted(manager.resident_ids) == [1, 2, 3]
    llm.shutdown()
    # Preempted and recomputed under a small KV pool: still each request's own tokens.
    small = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 12, "block_size": 4},
                scheduler={"max_num_seqs": 8},
                lora={"enabled": True, "max_loras": 3, "max_lora_rank": 16})
    again = small.generate([p for p, _ in batch], greedy(), lora_request=[lr for _, lr in batch],
                           use_tqdm=False)
    assert small.engine.stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in mixed]
    small.shutdown()


def test_more_adapters_than_slots_complete_in_arrival_order(adapters, tmp_path, monkeypatch):
    """Four adapters, two slots, two kept in memory: every request completes with its own
    adapter's tokens; no step holds more than two adapters; adapters are first scheduled in
    the order their requests arrived; evicted adapters are read again from disk."""
    model_dir, r8, r16 = adapters["llama"]
    dirs = [r8, r16, build_adapter(model_dir, tmp_path / "c", r=4, lora_alpha=8, seed=5),
            build_adapter(model_dir, tmp_path / "d", r=12, lora_alpha=12, seed=6)]
    loras = [LoRARequest(f"l{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    llm = lora_llm(model_dir, max_loras=2, max_cpu_loras=2)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(PROMPTS[i % 4]) for i in range(8)]
    order = [loras[i // 2] for i in range(8)]  # two requests per adapter, arriving in order
    alone = [llm.generate([p], greedy(), lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids
             for p, lr in zip(prompts, order)]
    manager = llm.engine.executor.runner.lora_manager
    loads_before = manager.num_loads
    steps: list[set[int]] = []
    first_scheduled: list[str] = []
    prepare = manager.prepare_step
    schedule = llm.engine.scheduler.schedule

    def watch_prepare(token_ids, logits_ids):
        steps.append({int(i) for i in np.unique(token_ids) if i > 0})
        return prepare(token_ids, logits_ids)

    def watch_schedule():
        out = schedule()
        first_scheduled.extend(n.req_id for n in out.scheduled_new_reqs)
        return out

    monkeypatch.setattr(manager, "prepare_step", watch_prepare)
    monkeypatch.setattr(llm.engine.scheduler, "schedule", watch_schedule)
    outs = llm.generate(prompts, greedy(), lora_request=order, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert max(len(s) for s in steps) == 2 and len(set().union(*steps)) == 4
    ids = [int(r) for r in first_scheduled]
    assert ids == sorted(ids)  # request ids count up in arrival order
    assert manager.num_loads > loads_before  # evicted from memory, read again
    assert len(manager.loaded_ids) <= 2 and len(manager.resident_ids) <= 2
    llm.shutdown()


@pytest.mark.slow
def test_step_graphs_with_adapters_equal_eager(adapters, monkeypatch):
    """Decode steps mixing adapters and base rows run through the inductor step graph (the C++
    LoRA kernel inside it, slots read from the mapping's tensor) with the bits of eager steps;
    this compiles (tens of seconds on 2 cores, cached on disk afterwards)."""
    from llmkit.compilation.inductor import InductorStepGraphs

    model_dir, r8, r16 = adapters["llama"]
    runs = {"graph": 0}
    run = InductorStepGraphs.run

    def counting_run(self, *args):
        runs["graph"] += 1
        return run(self, *args)

    monkeypatch.setattr(InductorStepGraphs, "run", counting_run)
    loras = [LoRARequest("r8", 1, str(r8)), None, LoRARequest("r16", 2, str(r16))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = {}
    for mode in ("eager", "graphs"):
        llm = LLM(str(model_dir), dtype="float32", compilation={"mode": mode},
                  kv_cache={"num_blocks": 128},
                  lora={"enabled": True, "max_loras": 2, "max_lora_rank": 16})
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in PROMPTS[:3]]
        results[mode] = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        if mode == "graphs":
            assert isinstance(llm.engine.executor.runner.step_graphs, InductorStepGraphs)
        llm.shutdown()
    assert runs["graph"] >= 11  # every decode step went through the graph
    for e, g in zip(results["eager"], results["graphs"]):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert {t: v.logprob for t, v in lp_g.items()} == \
                {t: v.logprob for t, v in lp_e.items()}


# ------------------------------------------------------------------ prefix caching

def test_prefix_cache_shared_within_an_adapter_only(adapters):
    model_dir, r8, r16 = adapters["llama"]
    llm = lora_llm(model_dir)
    prompt = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 can be shared
    a, b = LoRARequest("a", 1, str(r8)), LoRARequest("b", 2, str(r16))

    def cached(lr):
        return llm.generate([prompt], greedy(2), lora_request=lr, use_tqdm=False)[0] \
            .num_cached_tokens

    assert cached(a) == 0
    assert cached(a) == 32  # the same adapter shares its blocks
    assert cached(b) == 0  # another adapter shares none
    assert cached(None) == 0  # nor does the base model
    assert cached(b) == 32 and cached(None) == 32
    llm.shutdown()


# ------------------------------------------------------------------ refusals

def _write_adapter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def llama_llm(adapters):
    model_dir, r8, _ = adapters["llama"]
    llm = lora_llm(model_dir, max_lora_rank=8)
    yield llm, r8
    llm.shutdown()


def _bad_cases(tmp: Path, good: Path) -> dict[str, tuple[Path, str]]:
    from safetensors.torch import load_file

    cfg = json.loads((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    wrong_shape = dict(tensors)
    wrong_shape[f"{q}.lora_A.weight"] = torch.zeros(8, 32)
    unknown = dict(tensors)
    unknown["base_model.model.model.layers.0.mlp.router.lora_A.weight"] = torch.zeros(8, 64)
    unknown["base_model.model.model.layers.0.mlp.router.lora_B.weight"] = torch.zeros(8, 8)
    half = {k: v for k, v in tensors.items() if k != f"{q}.lora_B.weight"}
    (tmp / "garbage").mkdir()
    (tmp / "garbage" / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp / "garbage" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    (tmp / "noconfig").mkdir()
    return {
        "missing folder": (tmp / "nowhere", "does not exist"),
        "no config": (tmp / "noconfig", "no adapter_config.json"),
        "bad json": (_write_adapter(tmp / "json", cfg, tensors), None),
        "garbage weights": (tmp / "garbage", "not a readable safetensors file"),
        "wrong shape": (_write_adapter(tmp / "shape", cfg, wrong_shape), "do not fit the base"),
        "unknown module": (_write_adapter(tmp / "module", cfg, unknown),
                           "no LoRA layer for"),
        "half a pair": (_write_adapter(tmp / "half", cfg, half), "needs lora_A and lora_B"),
        "dora": (_write_adapter(tmp / "dora", {**cfg, "use_dora": True}, tensors), "DoRA"),
        "modules_to_save": (_write_adapter(tmp / "mts", {**cfg, "modules_to_save": ["lm_head"]},
                                           tensors), "modules_to_save"),
    }


def test_bad_adapters_fail_their_load_clearly(llama_llm, tmp_path):
    llm, good = llama_llm
    cases = _bad_cases(tmp_path, good)
    (cases["bad json"][0] / "adapter_config.json").write_text("{not json")
    cases["bad json"] = (cases["bad json"][0], "not valid JSON")
    for i, (what, (path, message)) in enumerate(cases.items()):
        with pytest.raises(LoRALoadError, match=message):
            llm.add_lora(LoRARequest(f"bad{i}", 100 + i, str(path)))
    # a rank above lora.max_lora_rank (8 here)
    r16 = good.parent / "r16"
    with pytest.raises(LoRALoadError, match="above lora.max_lora_rank"):
        llm.generate(["Hello"], greedy(2), lora_request=LoRARequest("big", 50, str(r16)),
                     use_tqdm=False)
    # an id already taken by another adapter; a name already taken
    llm.add_lora(LoRARequest("good", 1, str(good)))
    with pytest.raises(ValueError, match="already adapter 'good'"):
        llm.add_lora(LoRARequest("other", 1, str(r16)))
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora(LoRARequest("good", 2, str(good)))
    # the engine goes on serving, with and without the good adapter
    out = llm.generate(["Hello", "Hello"], greedy(3),
                       lora_request=[None, LoRARequest("good", 1, str(good))], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert [lr.lora_name for lr in llm.list_loras()] == ["good"]
    assert llm.engine.scheduler.get_num_unfinished_requests() == 0
    # stream and chat take the adapter too
    good_lr = LoRARequest("good", 1, str(good))
    whole = llm.generate(["Hello"], greedy(4), lora_request=good_lr, use_tqdm=False)[0]
    streamed = "".join(d.outputs[0].text for d in llm.stream("Hello", greedy(4),
                                                             lora_request=good_lr))
    assert streamed == whole.outputs[0].text
    msgs = [{"role": "user", "content": "Hi"}]
    chat = llm.chat(msgs, greedy(4), lora_request=good_lr, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids != llm.chat(msgs, greedy(4), use_tqdm=False)[0] \
        .outputs[0].token_ids


def test_unsupported_combinations_fail_at_start(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="model.linear_method: .*cannot be wrapped by LoRA"):
        LLM(str(model_dir), dtype="float32", lora={"enabled": True},
            overrides=["model.linear_method=helpers.lora_adapters.NoLoRALinearMethod"])
    with pytest.raises(ConfigError, match="lora.modules"):
        LLM(str(model_dir), dtype="float32", lora={"enabled": True,
                                                   "modules": ["x=/does/not/exist"]})
    with pytest.raises(ConfigError, match="lora.enabled=true"):
        LLM(str(model_dir), dtype="float32", lora={"modules": ["x=/y"]})
    llm = LLM(str(model_dir), dtype="float32", kv_cache={"num_blocks": 64})
    with pytest.raises(ValueError, match="lora.enabled=true"):
        llm.generate(["Hi"], greedy(2), lora_request=LoRARequest("a", 1, "/x"), use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1"])
def test_adapters_over_kept_gguf_blocks_match_the_float_reference(weight_type, tiny_model_dir,
                                                                  tmp_path):
    """A GGUF stays packed under LoRA (the base GEMM on the blocks, the delta in float, the
    tied LM head on the packed embedding): greedy tokens equal the same adapters over the
    dequantized weights with a reference linear of the kernel's arithmetic (float64 products
    of the kernel's 8-bit activations), and so do the logprobs, to float32 rounding.

    The kernel quantizes each linear's input to 8 bits per block. Where the float32 engine and
    the float64 reference differ in an activation's last bit and that value sits on a rounding
    boundary, it moves one 8-bit step (which one depends on the thread count's summation
    order): that moves the later logprobs of its sequence by up to ~1e-2. So: every token
    equal, nearly every logprob within float32 rounding, none beyond one such step."""
    from helpers.tiny_models import write_tiny_gguf

    model_dir = tiny_model_dir("mistral")  # tied embedding: the head multiplies packed rows
    path = write_tiny_gguf(model_dir, tmp_path / "m.gguf", weight_type)
    adapter = build_adapter(model_dir, tmp_path / "a", r=8, lora_alpha=16, seed=4,
                            target_modules=ALL_LINEAR + ("embed_tokens",))
    prompts = [[5, 9, 33, 2, 71, 8], [17, 18, 19, 20, 21, 22, 23], [40, 41, 42]]
    lr = LoRARequest("a", 1, str(adapter))

    def run(**kw):
        llm = LLM(str(path), dtype="float32", platform={"native_kernels": "on"},
                  kv_cache={"num_blocks": 64}, lora={"enabled": True, "max_lora_rank": 8},
                  **kw)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts * 2, params, lora_request=[lr] * 3 + [None] * 3,
                            use_tqdm=False)
        methods = llm.engine.executor.backend_info.linear_methods
        llm.shutdown()
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in
                                          zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs], methods

    kept, methods = run()
    assert methods and all(m.startswith("lora[") and "quantized:" in m for m in methods), \
        methods
    reference = "model.linear_method=helpers.quant_reference.GGUFReference"
    ref, ref_methods = run(quantization="none", overrides=[reference])
    assert all("gguf-reference" in m for m in ref_methods), ref_methods
    diffs = []
    for (tokens, lps), (ref_tokens, ref_lps) in zip(kept, ref):
        assert tokens == ref_tokens
        diffs += [abs(a - b) for a, b in zip(lps, ref_lps)]
    assert sum(d <= 2e-5 for d in diffs) >= 0.5 * len(diffs), sorted(diffs)
    assert max(diffs) <= 5e-2, sorted(diffs)
    assert [t for t, _ in kept[:3]] != [t for t, _ in kept[3:]]  # the adapter is applied


def test_cli_generate_runs_with_lora_cli_adapter(llama_llm, capsys):
    """``llmkit generate`` with ``lora.cli_adapter``: the text LLM gives under that adapter."""
    from llmkit.config.compose import build_config
    from llmkit.entrypoints.offline import run_generate, sampling_params_from

    llm, good = llama_llm
    model_dir = Path(llm.config.model.path)
    cfg = build_config(str(model_dir), dtype="float32", groups={
        "lora": {"enabled": True, "max_lora_rank": 8, "modules": [f"good={good}"],
                 "cli_adapter": "good"},
        "sampling": {"max_tokens": MAX_TOKENS}, "kv_cache": {"num_blocks": 64}})
    params = sampling_params_from(cfg)
    want = llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("good", 1, str(good)),
                        use_tqdm=False)[0].outputs[0].text
    base = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
    assert want != base  # the adapter changes this prompt's text
    capsys.readouterr()
    assert run_generate(cfg, PROMPTS[0]) == 0
    assert capsys.readouterr().out == want + "\n"
    with pytest.raises(ConfigError, match="cli_adapter 'nope' is not an adapter"):
        build_config(str(model_dir), groups={"lora": {"enabled": True, "cli_adapter": "nope",
                                                      "modules": [f"good={good}"]}})


def test_executor_and_scheduler_must_support_lora():
    from llmkit.engine.loop.core_builder import check_lora_support
    from llmkit.scheduler.base import Scheduler

    class PlainScheduler(Scheduler):  # no max_loras in its constructor
        def __init__(self, config, kv, *, max_model_len, eos_token_id=None, clock=None):
            pass

    class Executor:
        supports_lora = True

    with pytest.raises(ConfigError, match="does not serve LoRA adapters"):
        check_lora_support(object(), TokenBudgetScheduler)
    with pytest.raises(ConfigError, match="cannot limit the adapters of a step"):
        check_lora_support(Executor(), PlainScheduler)
    check_lora_support(Executor(), TokenBudgetScheduler)


def test_engine_and_server_number_configured_adapters_alike():
    """``lora.modules`` get ids 1..n in order in the engine's table and in the server's names
    alike (one numbering, llmkit/lora/adapters.py); runtime loads take the ids after them."""
    from llmkit.config.schema import LoRAConfig
    from llmkit.entrypoints.openai.serving_models import ServingModels
    from llmkit.lora.adapters import AdapterTable, configured_adapters

    cfg = LoRAConfig(enabled=True, modules=["a=/x/a", "b=/x/b"])
    loaded: list[LoRARequest] = []
    table = AdapterTable(True, loaded.append, lambda lora_id: None)
    for lr in configured_adapters(cfg):
        table.add(lr)
    served = ServingModels(None, ["base"], cfg)
    assert {lr.lora_name: lr.lora_int_id for lr in loaded} == \
        {name: lr.lora_int_id for name, lr in served.adapters.items()} == {"a": 1, "b": 2}
    assert next(served._ids) == 3


# ------------------------------------------------------------------ the scheduler's slot rule

def _sched(max_loras: int, **cfg):
    kv = KVCacheManager(256, 4, enable_prefix_caching=True, max_model_len=256)
    return TokenBudgetScheduler(SchedulerConfig(**cfg), kv, max_model_len=256, eos_token_id=0,
                                max_loras=max_loras, max_lora_skips=3)


def _run(sched, out):
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
               else [] for r in out.num_scheduled_tokens]
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))


def _lora_req(rid: str, lora_id: int | None, max_tokens: int = 4) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lora_id=lora_id, lora_name=None if lora_id is None else f"a{lora_id}")


def test_scheduler_skips_then_bounds_the_wait():
    """One slot: a request of adapter 2 is passed over while adapter 1 runs, later requests of
    adapter 1 and base requests go ahead; after max_lora_skips (3) steps it blocks the queue
    behind it, and is admitted as soon as adapter 1's running requests end."""
    sched = _sched(1, max_num_seqs=8)
    sched.add_request(_lora_req("a0", 1, max_tokens=6))
    sched.add_request(_lora_req("b0", 2))
    admitted_at: dict[str, int] = {}
    for step in range(40):
        if step < 12:  # adapter 1 keeps arriving
            sched.add_request(_lora_req(f"a{step + 1}", 1, max_tokens=6))
            sched.add_request(_lora_req(f"base{step}", None, max_tokens=2))
        out = sched.schedule()
        loras = {sched.requests[r].lora_id for r in out.num_scheduled_tokens} - {None}
        assert len(loras) <= 1
        for n in out.scheduled_new_reqs:
            admitted_at.setdefault(n.req_id, step)
        _run(sched, out)
        stats = sched.stats()
        if "b0" not in admitted_at and step >= 1:
            assert stats.waiting_lora_adapters.get("a2") == 1
    # b0 waited: 3 skips, then at most until adapter 1's requests admitted before it ended
    assert admitted_at["b0"] <= 3 + 6 + 1
    assert admitted_at["a1"] == 0 and admitted_at["base0"] == 0  # later ones went ahead
    late = [r for r, s in admitted_at.items() if r.startswith("a") and s > admitted_at["b0"]]
    assert late  # adapter 1's later requests waited behind b0 once it blocked
    assert not sched.has_unfinished_requests()


def test_scheduler_stats_count_requests_per_adapter():
    sched = _sched(2)
    for rid, lora in (("x", 1), ("y", 1), ("z", 2), ("w", None), ("v", 3)):
        sched.add_request(_lora_req(rid, lora))
    out = sched.schedule()
    assert {sched.requests[r].lora_id for r in out.num_scheduled_tokens} == {1, 2, None}
    stats = sched.stats()
    assert stats.running_lora_adapters == {"a1": 2, "a2": 1}
    assert stats.waiting_lora_adapters == {"a3": 1}


# ------------------------------------------------------------------ the batched ops

def _stack(num_slots=4, rank=8, inp=48, outs=(32, 16, 16), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = StackedLoRA.empty(num_slots, rank, inp, outs, dtype)
    ranks = [[8, 8, 8], [4, 4, 0], [8, 0, 8], [2, 2, 2]][:num_slots]
    for s, rs in enumerate(ranks):
        for sh, r in enumerate(rs):
            o0, o1 = w.out_offsets[sh], w.out_offsets[sh + 1]
            w.a[s, sh * rank:sh * rank + r] = torch.randn(r, inp, generator=g).to(dtype)
            w.b[s, :r, o0:o1] = torch.randn(r, o1 - o0, generator=g).to(dtype)
        w.set_ranks(s, rs)
    return w


def _reference(y, x, w, slots):
    from llmkit.kernels.lora import add_lora_ref

    out = y.clone()
    add_lora_ref(out, x, w.a, w.b, w.out_offsets_device, torch.from_numpy(slots))
    return out


SLOTS = np.array([0, 1, -1, 1, 3, 3, 3, -1, 0, 2, 2, 1, 0], dtype=np.int32)


@pytest.mark.parametrize("rows", [5, 13])
def test_torch_and_cpu_ops_match_reference(rows):
    from llmkit.kernels.cpu_native import load_cpu_kernels

    w = _stack()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 48, generator=g), torch.randn(rows, 64, generator=g)
    slots = SLOTS[:rows]
    want = _reference(y, x, w, slots)
    for ops in (TorchLoRAOps(), CpuLoRAOps(load_cpu_kernels())):
        got = y.clone()
        ops.add_lora(got, x, w, RowSlots(slots, torch.device("cpu")))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        assert torch.equal(got[slots < 0], y[slots < 0])  # base rows untouched


def test_cpu_kernel_bf16_matches_reference():
    from llmkit.kernels.cpu_native import load_cpu_kernels

    w = _stack(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 48, generator=g).bfloat16()
    y = torch.randn(7, 64, generator=g).bfloat16()
    slots = SLOTS[:7]
    got = y.clone()
    CpuLoRAOps(load_cpu_kernels()).add_lora(got, x, w, RowSlots(slots, torch.device("cpu")))
    torch.testing.assert_close(got.float(), _reference(y, x, w, slots).float(), atol=0.25,
                               rtol=2e-2)


def test_triton_ops_match_reference_interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w = _stack()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(13, 48, generator=g), torch.randn(13, 64, generator=g)
    got = y.clone()
    TritonLoRAOps().add_lora(got, x, w, RowSlots(SLOTS, torch.device("cpu")))
    torch.testing.assert_close(got, _reference(y, x, w, SLOTS), atol=1e-4, rtol=1e-5)


def test_embedding_lora_matches_peft_formula():
    g = torch.Generator().manual_seed(4)
    vocab, hidden, rank = 40, 16, 4
    w = StackedLoRA.empty(2, 8, vocab, (hidden,), torch.float32, embedding=True)
    a, b = torch.randn(rank, vocab, generator=g), torch.randn(hidden, rank, generator=g)
    w.a[1, :, :rank] = a.T
    w.b[1, :rank] = b.T
    w.set_ranks(1, [rank])
    ids = torch.tensor([3, 7, 7, 39, 0])
    slots = np.array([1, -1, 1, 1, -1], dtype=np.int32)
    y = torch.zeros(5, hidden)
    TorchLoRAOps().add_embedding_lora(y, ids, w, RowSlots(slots, torch.device("cpu")))
    want = torch.nn.functional.embedding(ids, a.T) @ b.T  # PEFT's Embedding.forward
    torch.testing.assert_close(y[slots >= 0], want[slots >= 0])
    assert not y[slots < 0].any()


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")


# ------------------------------------------------------------------ benchmarks

def test_bench_spreads_requests_over_adapters(adapters):
    from llmkit.tools.bench.client import ClientOptions, _payload
    from llmkit.tools.bench.datasets import WorkloadError, build_workload
    from llmkit.tools.bench.throughput import run_throughput
    from llmkit.tools.compose import build_tool_config
    from llmkit.tools.schema import BenchToolConfig

    model_dir, r8, r16 = adapters["llama"]
    bench = {"num_requests": 6, "input_len": 12, "output_len": 4, "progress": False,
             "lora_names": ["a", "b"]}
    cfg = build_tool_config(BenchToolConfig, str(model_dir), dtype="float32", groups={
        "lora": {"enabled": True, "modules": [f"a={r8}", f"b={r16}"]}, "bench": bench,
        "kv_cache": {"num_blocks": 128}})
    from transformers import AutoTokenizer

    workload = build_workload(cfg.bench, AutoTokenizer.from_pretrained(str(model_dir)))
    assert [r.lora_name for r in workload] == ["a", "b"] * 3
    assert _payload(workload[1], ClientOptions(), "base")["model"] == "b"
    result = run_throughput(cfg)
    assert result["summary"]["completed"] == 6
    assert result["summary"]["total_output_tokens"] == 24
    bad = cfg.model_copy(update={"bench": cfg.bench.model_copy(update={"lora_names": ["x"]})})
    with pytest.raises(WorkloadError, match="not in lora.modules"):
        run_throughput(bad)


def test_bench_latency_and_sim_refuse_lora_names():
    """Tools that cannot spread requests over adapters refuse bench.lora_names (never ignore
    it silently)."""
    from llmkit.tools.bench.latency import run_latency
    from llmkit.tools.compose import build_tool_config
    from llmkit.tools.schema import BenchToolConfig, SimToolConfig
    from llmkit.tools.sim.replay import run_sim

    groups = {"bench": {"lora_names": ["a"]}}
    with pytest.raises(ConfigError, match="bench.lora_names: bench latency"):
        run_latency(build_tool_config(BenchToolConfig, groups=groups))
    with pytest.raises(ConfigError, match="bench.lora_names: the simulator"):
        run_sim(build_tool_config(SimToolConfig, groups=groups))

