"""Mixture of experts (issue 22 item 5): the fused-MoE op's three paths against its
definition, the MoE architectures against Hugging Face, tensor and expert parallel against
the single-process engine, and the start-up errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit.ops.moe import fused_moe_grouped, fused_moe_reference, fused_topk


def _moe_case(t: int, hidden: int = 32, inter: int = 24, experts: int = 6, top_k: int = 2,
              seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = fused_topk(torch.randn(t, experts, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _by_hand(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def test_topk_softmax_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = fused_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int32
    torch.testing.assert_close(w, probs[:, :2])
    w, _ = fused_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w, probs[:, :2] / probs[:, :2].sum())


def test_reference_is_the_definition():
    case = _moe_case(5)
    torch.testing.assert_close(fused_moe_reference(*case), _by_hand(*case))


@pytest.mark.parametrize("t", [0, 1, 9, 40])  # none, decode-sized, more than the experts
def test_grouped_cpu_path_matches_the_reference(t):
    case = _moe_case(t)
    torch.testing.assert_close(fused_moe_grouped(*case), fused_moe_reference(*case))


def test_grouped_bf16_experts_widened_to_float32_for_large_groups(monkeypatch):
    """bf16 experts with more tokens than the threshold compute in float32 (CPUs without
    native bf16 emulate bf16 GEMMs), the smaller groups stay bf16; as close to the
    definition either way."""
    import llmkit.ops.moe as moe_ops

    x, w13, w2, weights, ids = (t.bfloat16() if t.is_floating_point() and i < 3 else t
                                for i, t in enumerate(_moe_case(40)))
    calls: list[tuple[int, bool]] = []
    real = moe_ops._expert_linear

    def spy(a, w, widen):
        calls.append((a.shape[0], widen))
        return real(a, w, widen)

    monkeypatch.setattr(moe_ops, "_expert_linear", spy)
    want = fused_moe_reference(x, w13, w2, weights, ids).float()
    counts = torch.bincount(ids.reshape(-1).long(), minlength=6)
    threshold = int(counts[counts > 0].min())  # the smallest group stays bf16, larger widen
    assert int(counts.max()) > threshold
    widened = fused_moe_grouped(x, w13, w2, weights, ids, widen_bf16_above=threshold)
    assert calls and all(widen == (rows > threshold) for rows, widen in calls), calls
    assert {widen for _, widen in calls} == {True, False}
    assert widened.dtype == torch.bfloat16
    torch.testing.assert_close(widened.float(), want, atol=3e-2, rtol=3e-2)
    calls.clear()
    fused_moe_grouped(x, w13, w2, weights, ids)  # the default: never
    assert calls and not any(widen for _, widen in calls)


def test_expert_parallel_parts_sum_to_the_whole():
    x, w13, w2, weights, ids = _moe_case(12)
    whole = fused_moe_reference(x, w13, w2, weights, ids)
    parts = []
    for rank in range(2):  # 6 experts over 2 ranks: rank r holds experts 3r..3r+2
        emap = torch.full((6,), -1, dtype=torch.int32)
        emap[3 * rank:3 * rank + 3] = torch.arange(3, dtype=torch.int32)
        local = (w13[3 * rank:3 * rank + 3], w2[3 * rank:3 * rank + 3])
        part = fused_moe_grouped(x, *local, weights, ids, emap)
        torch.testing.assert_close(part, fused_moe_reference(x, *local, weights, ids, emap))
        parts.append(part)
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_grouped_path_is_one_opaque_op_in_a_compiled_graph():
    case = _moe_case(4)
    compiled = torch.compile(fused_moe_grouped, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*case), fused_moe_reference(*case))


@pytest.mark.parametrize("t,expert_parallel", [(1, False), (21, False), (21, True)])
def test_triton_fused_moe_interpreted_matches_the_reference(monkeypatch, t, expert_parallel):
    from llmkit.kernels import count_launches, fused_moe

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w13, w2, weights, ids = _moe_case(t)
    emap = None
    if expert_parallel:  # this rank holds experts 2..4 of 6
        emap = torch.tensor([-1, -1, 0, 1, 2, -1], dtype=torch.int32)
        w13, w2 = w13[2:5], w2[2:5]
    want = fused_moe_reference(x, w13, w2, weights, ids, emap)
    with count_launches() as launches:
        got = fused_moe(x, w13, w2, weights, ids, emap)
    assert launches["_fused_moe_kernel"] == 2 and launches["_silu_and_mul_kernel"] == 1
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_align_block_size_groups_slots_by_expert_in_whole_blocks():
    from llmkit.kernels import moe_align_block_size

    ids = torch.tensor([2, 0, 2, 3, 0, 2])  # 3 = another rank's expert (3 local experts)
    slots, experts = moe_align_block_size(ids, 3, 4)
    assert slots.shape[0] == experts.shape[0] * 4
    # expert 0: slots 1, 4 (+ padding); expert 1: none; expert 2: slots 0, 2, 5
    assert slots[:8].tolist() == [1, 4, 6, 6, 0, 2, 5, 6]
    assert experts.tolist()[:2] == [0, 2] and set(experts.tolist()[2:]) == {3}


# -- the MoE architectures against Hugging Face ----------------------------------------------
PROMPTS = ["The quick brown fox", "Paris is the capital of", "One, two, three"]
MAX_TOKENS = 6
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _greedy():
    from llmkit import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)  # stops at EOS, as HF does


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(), use_tqdm=False)]


def _hf_greedy(model_dir, tokenizer) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tokenizer(p)["input_ids"]])
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(ids),
                                 pad_token_id=tokenizer.pad_token_id)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def single_process_tokens(tiny_model_dir):
    """Greedy tokens of the single-process engine per MoE arch (computed once)."""
    from llmkit import LLM

    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            llm = LLM(str(tiny_model_dir(arch)), dtype="float32")
            try:
                cache[arch] = _tokens(llm)
            finally:
                llm.engine.shutdown()
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_tokens_match_hf(arch, tiny_model_dir, tiny_tokenizer, single_process_tokens):
    want = _hf_greedy(tiny_model_dir(arch), tiny_tokenizer)
    assert single_process_tokens(arch) == want


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_match_hf_through_prefill_and_decode(arch, tiny_model_dir, tiny_tokenizer):
    """The CPU platform's ops and linear methods (C++ kernels where they build): every
    position's logits of a prefill, then two decode steps, equal HF's."""
    from helpers.model_logits import PagedRun, assert_close, hf_logits, load_llmkit, random_seqs

    model_dir = tiny_model_dir(arch)
    seq = random_seqs(len(tiny_tokenizer), [10])[0]
    ref = hf_logits(model_dir, [seq])[0]
    run = PagedRun(load_llmkit(model_dir, kernels="native")[0], 1, len(seq))
    assert_close(run.step({0: seq[:8]})[0], ref[:8])
    for t in (8, 9):
        assert_close(run.step({0: seq[t:t + 1]})[0], ref[t:t + 1])


def test_triton_ops_moe_model_matches_hf(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """The CUDA platform's ops, the Triton fused-MoE kernel among them (interpreted here):
    Qwen2-MoE's logits equal HF's."""
    from helpers.model_logits import PagedRun, assert_close, hf_logits, random_seqs

    from llmkit.attention.triton_backend import TritonAttentionBackend
    from llmkit.config.schema import ModelConfig
    from llmkit.kernels import count_launches
    from llmkit.models.base import ModelContext
    from llmkit.models.loader import build_model, resolve_model_source
    from llmkit.ops.triton_ops import TritonOps

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model_dir = tiny_model_dir("qwen2_moe")
    ops = TritonOps()
    model = build_model(resolve_model_source(ModelConfig(path=str(model_dir))),
                        ModelContext(TritonAttentionBackend(ops), torch.float32, ops))
    seq = random_seqs(len(tiny_tokenizer), [7])[0]
    ref = hf_logits(model_dir, [seq])[0]
    run = PagedRun(model, 1, len(seq))
    with count_launches() as launches:
        assert_close(run.step({0: seq[:6]})[0], ref[:6], atol=2e-4)
        assert_close(run.step({0: seq[6:7]})[0], ref[6:7], atol=2e-4)
    assert launches["_fused_moe_kernel"] == 2 * 2 * 2  # 2 steps x 2 MoE layers x 2 GEMMs


def test_moe_model_layout(tiny_model_dir):
    """Experts stacked at load; Qwen2-MoE's layer 1 is dense (mlp_only_layers), the others a
    MoE block with a shared expert."""
    from safetensors.torch import load_file

    from llmkit.attention.torch_backend import TorchAttentionBackend
    from llmkit.config.schema import ModelConfig
    from llmkit.models.base import ModelContext
    from llmkit.models.layers.moe import FusedMoE
    from llmkit.models.llama import LlamaMLP
    from llmkit.models.loader import build_model, resolve_model_source

    path = tiny_model_dir("qwen2_moe")
    model = build_model(resolve_model_source(ModelConfig(path=str(path))),
                        ModelContext(TorchAttentionBackend()))
    mlps = [layer.mlp for layer in model.model.layers]
    assert isinstance(mlps[1], LlamaMLP)
    assert isinstance(mlps[0].experts, FusedMoE) and mlps[0].shared_expert is not None
    ckpt = load_file(str(path / "model.safetensors"))
    w13, w2 = mlps[2].experts.w13_weight, mlps[2].experts.w2_weight
    assert w13.shape == (4, 64, 64) and w2.shape == (4, 64, 32)
    p = "model.layers.2.mlp.experts.3"
    torch.testing.assert_close(w13[3, :32], ckpt[f"{p}.gate_proj.weight"])
    torch.testing.assert_close(w13[3, 32:], ckpt[f"{p}.up_proj.weight"])
    torch.testing.assert_close(w2[3], ckpt[f"{p}.down_proj.weight"])


def test_missing_expert_weight_is_reported(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from llmkit import LLM

    src = tiny_model_dir("mixtral")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"lacks 1 expert weight.*layers\.1\.mlp\.experts\.2\.w3"):
        LLM(str(dst), dtype="float32")


# -- the expert split itself, every rank in one process (no collectives) ---------------------
@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_expert_shards_recompose_the_whole_layer(tp_size, expert_parallel):
    from llmkit.distributed.group import TensorParallelGroup
    from llmkit.models.layers.moe import FusedMoE
    from llmkit.ops.base import ModelOps

    experts, hidden, inter = 8, 16, 12
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(2, experts, inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    x, logits = torch.randn(5, hidden, generator=g), torch.randn(5, experts, generator=g)

    def build(rank: int, size: int) -> FusedMoE:
        moe = FusedMoE("experts", experts, 3, hidden, inter, renormalize=False,
                       dtype=torch.float32, ops=ModelOps(), tp=TensorParallelGroup(rank, size),
                       expert_parallel=expert_parallel)
        for e in range(experts):
            for shard, w in (("w1", gate[e]), ("w3", up[e]), ("w2", down[e])):
                moe.load_expert_weight(e, shard, w)
        return moe

    whole = build(0, 1)(x, logits)
    ranks = [build(r, tp_size) for r in range(tp_size)]
    if expert_parallel:  # whole experts per rank
        assert all(m.w13_weight.shape == (experts // tp_size, 2 * inter, hidden) for m in ranks)
    else:  # every expert, a slice of its intermediate rows
        assert all(m.w2_weight.shape == (experts, hidden, inter // tp_size) for m in ranks)
    torch.testing.assert_close(sum(m(x, logits) for m in ranks), whole)


# -- tensor and expert parallel over worker processes ----------------------------------------
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_tensor_and_expert_parallel_match_the_single_process_engine(
        arch, expert_parallel, tiny_model_dir, single_process_tokens, monkeypatch):
    from llmkit import LLM

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    want = single_process_tokens(arch)
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32",
              parallel={"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel})
    try:
        methods = llm.engine.backend_info.linear_methods
        split = "expert-parallel[0/2]" if expert_parallel else "tensor-parallel[0/2]"
        assert any(m.startswith(f"fused-moe-{split}") for m in methods), methods
        assert _tokens(llm) == want
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # 4 worker processes on 2 cores
def test_pipeline_stages_with_expert_parallel_match_the_single_process_engine(
        tiny_model_dir, single_process_tokens, monkeypatch):
    """TP=2 x PP=2 with expert parallel (4 processes): each stage builds and loads only its
    layers, MoE blocks (a dense one among them) included; experts split within a stage."""
    from llmkit import LLM

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    want = single_process_tokens("qwen2_moe")
    llm = LLM(str(tiny_model_dir("qwen2_moe")), dtype="float32",
              parallel={"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                        "enable_expert_parallel": True})
    try:
        assert len(llm.engine.executor.workers) == 4
        assert _tokens(llm) == want
    finally:
        llm.engine.shutdown()


# -- start-up errors -------------------------------------------------------------------------
@pytest.mark.parametrize("arch,overrides,parallel,text", [
    # 3 experts over 2 expert-parallel ranks
    ("mixtral", {"num_local_experts": 3}, {"enable_expert_parallel": True},
     "a divisor of the model's 3 experts with parallel.enable_expert_parallel=true (1, 3)"),
    # each expert's 33 intermediate rows over 2 tensor-parallel ranks
    ("qwen3_moe", {"moe_intermediate_size": 33}, {},
     "a divisor of the experts' intermediate size 33 (1, 3, 11, 33), or "
     "parallel.enable_expert_parallel=true"),
])
def test_moe_sizes_that_do_not_divide_are_config_errors(tiny_model_dir, arch, overrides,
                                                        parallel, text):
    from llmkit import LLM
    from llmkit.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_model_dir(arch, **overrides)), dtype="float32",
            parallel={"tensor_parallel_size": 2, **parallel})
    assert err.value.key == "parallel.tensor_parallel_size"
    assert text in str(err.value) and "\n" not in str(err.value)


def test_expert_parallel_on_a_dense_model_is_a_config_error(tiny_model_dir):
    from llmkit import LLM
    from llmkit.config.errors import ConfigError

    for tp in (2, 1):  # one worker too: the flag would otherwise do nothing
        with pytest.raises(ConfigError,
                           match=r"^parallel.enable_expert_parallel: .*dense model"):
            LLM(str(tiny_model_dir("llama")), dtype="float32",
                parallel={"tensor_parallel_size": tp, "enable_expert_parallel": True})


def test_quantizing_a_moe_model_is_a_config_error(tiny_model_dir):
    from llmkit import LLM
    from llmkit.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.quantization: got 'int8'; .*experts"):
        LLM(str(tiny_model_dir("qwen3_moe")), dtype="float32", quantization="int8")
