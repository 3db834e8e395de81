"""Check a shipped GPU profile against the real device: the cost model's predictions next to
measurements of the same work in plain torch. A validation, never a fit: nothing here writes a
profile or changes an efficiency.

    python llmkit/tools/sim/gpu_check.py --hardware h200 --shape llama-2-7b --out result.json

Measured on the device (CUDA events around synchronised calls, best of a few repetitions):

1. the peaks × efficiencies the profile claims: a large bf16 GEMM and a device copy;
2. decode steps of the model's shape (random weights, bf16): ``batch`` sequences each adding one
   token to ``ctx`` cached tokens — per layer RMSNorm, fused QKV GEMM, the new K/V written into a
   cache, SDPA over the cache, output projection, RMSNorm, gate-up GEMM, SiLU·mul, down GEMM;
   then the LM head — eager, and replayed from a CUDA graph;
3. prefills of one prompt (causal SDPA).

It runs where only torch and PyYAML exist (a bare GPU machine): ``llmkit`` is loaded as a bare
namespace so that ``llmkit/__init__`` (msgspec, pydantic) is not imported.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

if __name__ == "__main__" and "llmkit" not in sys.modules:  # pragma: no cover - device script
    _root = Path(__file__).resolve().parents[3]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    sys.path.insert(0, str(_root))
    _pkg = types.ModuleType("llmkit")
    _pkg.__path__ = [str(_root / "llmkit")]  # type: ignore[attr-defined]
    sys.modules["llmkit"] = _pkg

from llmkit.cost_model.hardware import HardwareProfile, load_profile_yaml  # noqa: E402
from llmkit.cost_model.model_shape import ModelShape, load_shape  # noqa: E402
from llmkit.cost_model.step_cost import CostModel  # noqa: E402


def _events_time(fn, reps: int = 5, warmup: int = 2) -> float:
    import torch

    if not torch.cuda.is_available():  # a CPU smoke test
        for _ in range(warmup):
            fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


class TorchDecoder:
    """The shape's layers with random bf16 weights (no embedding table: inputs are hidden
    states)."""

    def __init__(self, shape: ModelShape, device: str, dtype) -> None:
        import torch

        s = shape
        self.s, self.device, self.dtype = s, device, dtype
        std = 0.02

        def w(*dims):
            return torch.empty(*dims, device=device, dtype=dtype).normal_(0, std)
        qkv = s.q_size + 2 * s.kv_size
        inter = s.intermediate_size
        self.layers = [dict(n1=torch.ones(s.hidden_size, device=device, dtype=dtype),
                            qkv=w(s.hidden_size, qkv), o=w(s.q_size, s.hidden_size),
                            n2=torch.ones(s.hidden_size, device=device, dtype=dtype),
                            gu=w(s.hidden_size, 2 * inter), down=w(inter, s.hidden_size))
                       for _ in range(s.num_layers)]
        self.lm_head = w(s.hidden_size, s.vocab_size)

    @staticmethod
    def _rms(x, g):
        import torch
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * g

    def decode(self, x, kcache, vcache, pos: int):
        """x [B, h]; caches [L][B, n_kv, C, d]; writes position ``pos`` and attends to 0..pos."""
        import torch.nn.functional as F

        s = self.s
        B = x.shape[0]
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["n1"])
            qkv = h @ L["qkv"]
            q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
            q = q.view(B, s.num_heads, 1, s.head_dim)
            kcache[li][:, :, pos] = k.view(B, s.num_kv_heads, s.head_dim)
            vcache[li][:, :, pos] = v.view(B, s.num_kv_heads, s.head_dim)
            kk = kcache[li][:, :, :pos + 1]
            vv = vcache[li][:, :, :pos + 1]
            o = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=s.num_kv_heads != s.num_heads)
            x = x + o.reshape(B, s.q_size) @ L["o"]
            h = self._rms(x, L["n2"])
            g, u = (h @ L["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["down"]
        return self._rms(x, self.layers[-1]["n2"]) @ self.lm_head

    def prefill(self, x):
        """x [T, h]: one causal prompt."""
        import torch.nn.functional as F

        s = self.s
        T = x.shape[0]
        for L in self.layers:
            h = self._rms(x, L["n1"])
            q, k, v = (h @ L["qkv"]).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
            # 4-D [1, heads, T, d]: the layout SDPA's flash kernel takes
            q = q.view(1, T, s.num_heads, s.head_dim).transpose(1, 2)
            k = k.view(1, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
            v = v.view(1, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=s.num_kv_heads != s.num_heads)
            x = x + o.transpose(1, 2).reshape(T, s.q_size) @ L["o"]
            h = self._rms(x, L["n2"])
            g, u = (h @ L["gu"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["down"]
        return self._rms(x[-1:], self.layers[-1]["n2"]) @ self.lm_head


def run(hardware: str, shape_name: str, device: str = "cuda", batches=(1, 8, 32, 64),
        contexts=(512, 2048), prompts=(512, 2048), gemm: int = 8192, buffer_mib: int = 4096
        ) -> dict:
    import torch

    from llmkit.tools.sim import calibrate

    root = Path(__file__).resolve().parents[3]
    hw = HardwareProfile.from_config(load_profile_yaml(root / "conf" / "tools" / "hardware" /
                                                       f"{hardware}.yaml"))
    shape = load_shape(shape_name)
    cm = CostModel(shape, hw, "bfloat16")
    out: dict = {"hardware": hardware, "shape": shape_name, "device": device,
                 "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "torch": torch.__version__}
    t0 = time.perf_counter()
    # 1. peaks
    f = calibrate.measure_gemm(gemm, "bfloat16", device, reps=10, budget_s=5)
    bw = calibrate.measure_bandwidth(buffer_mib, device, reps=10)
    op = calibrate.measure_op_overhead(device)
    out["peaks"] = {
        "gemm_bf16_tflops": f / 1e12, "profile_peak_tflops": hw.peak("bfloat16") / 1e12,
        "profile_compute_eff": hw.compute_efficiency, "gemm_fraction_of_peak":
            f / hw.peak("bfloat16"),
        "copy_gbs": bw["copy"] / 1e9, "read_gbs": bw["read"] / 1e9,
        "profile_bandwidth_gbs": hw.memory_bandwidth / 1e9,
        "profile_memory_eff": hw.memory_efficiency,
        "copy_fraction_of_peak": bw["copy"] / hw.memory_bandwidth,
        "read_fraction_of_peak": bw["read"] / hw.memory_bandwidth,
        "tiny_op_us": op * 1e6,
    }
    print(json.dumps(out["peaks"], indent=1), flush=True)
    dt = torch.bfloat16
    model = TorchDecoder(shape, device, dt)
    rows = []
    for C in (contexts if batches else ()):
        for B in batches:
            kc = [torch.zeros(B, shape.num_kv_heads, C, shape.head_dim, device=device, dtype=dt)
                  for _ in range(shape.num_layers)]
            vc = [torch.zeros_like(k) for k in kc]
            x = torch.randn(B, shape.hidden_size, device=device, dtype=dt)
            pos = C - 1
            with torch.no_grad():
                eager = _events_time(lambda: model.decode(x, kc, vc, pos))
                graph_t = None
                try:
                    if device != "cuda":
                        raise RuntimeError("no CUDA graphs on " + device)
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(2):
                            model.decode(x, kc, vc, pos)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        model.decode(x, kc, vc, pos)
                    graph_t = _events_time(g.replay, reps=10)
                    del g
                except Exception as e:  # noqa: BLE001 - report, keep going
                    if device == "cuda":
                        print(f"graph capture failed: {e}", flush=True)
            pred = cm.decode_step(B, C)
            row = {"kind": "decode", "batch": B, "ctx": C, "eager_ms": eager * 1e3,
                   "graph_ms": None if graph_t is None else graph_t * 1e3,
                   "model_ms": pred.total_s * 1e3,
                   "model_without_overhead_ms": (pred.total_s - pred.overhead_s) * 1e3,
                   "model_bound": pred.bound,
                   "bytes_gb": pred.bytes / 1e9,
                   "measured_mbu_graph": None if graph_t is None else
                   pred.bytes / graph_t / hw.memory_bandwidth}
            if graph_t:
                row["error_vs_graph"] = pred.total_s / graph_t - 1
            rows.append(row)
            print(json.dumps(row), flush=True)
            kc = vc = None  # free the caches before the next size
            if device == "cuda":
                torch.cuda.empty_cache()
    for T in prompts:
        x = torch.randn(T, shape.hidden_size, device=device, dtype=dt)
        with torch.no_grad():
            t = _events_time(lambda: model.prefill(x), reps=3)
        pred = cm.prefill_step([T])
        row = {"kind": "prefill", "tokens": T, "eager_ms": t * 1e3,
               "model_ms": pred.total_s * 1e3, "model_bound": pred.bound,
               "measured_mfu": pred.flops / t / hw.peak("bfloat16"),
               "error_vs_eager": pred.total_s / t - 1}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["rows"] = rows
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--prefill-only", action="store_true")
    a = ap.parse_args(argv)
    kw = {}
    if a.prefill_only:
        kw = dict(batches=(), prompts=(512, 2048, 4096, 8192))
    if a.quick:
        kw = dict(batches=(1, 2), contexts=(16,), prompts=(16,), gemm=128, buffer_mib=8)
    res = run(a.hardware, a.shape, a.device, **kw)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
