"""examples/train_tiny_lora.py cannot rot: its command line, run for a couple of steps on a
tiny random model given as a GGUF (the path the example takes with the default model), writes a
PEFT adapter that llmkit's engine loads and runs."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from helpers.tiny_models import write_tiny_gguf

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_lora.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("train_tiny_lora", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tiny_lora_writes_an_adapter_llmkit_runs(tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from llmkit import LLM, LoRARequest, SamplingParams

    example = _load_example()
    gguf = write_tiny_gguf(tiny_model_dir("llama"), tmp_path / "tiny.gguf")
    out = tmp_path / "adapter"
    assert example.main(["--model", str(gguf), "--out", str(out), "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "step 2/2" in printed
    assert f"lora.modules=['pirate={out}']" in printed and '"model": "pirate"' in printed

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == sorted(
        example.TARGET_MODULES)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    b = [t for k, t in tensors.items() if "lora_B" in k]
    assert len(b) == 7 * 2  # seven projections in each of the tiny model's two layers
    assert any(t.abs().max() > 0 for t in b)  # trained: PEFT starts every B at zero
    assert (out / ".gitignore").read_text().strip().endswith("*")  # never committed

    llm = LLM(str(gguf), dtype="float32", kv_cache={"num_blocks": 64},
              lora={"enabled": True, "max_loras": 1, "max_lora_rank": 8})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        [res] = llm.chat([{"role": "user", "content": "Hello"}], params,
                         lora_request=LoRARequest("pirate", 1, str(out)), use_tqdm=False)
        assert len(res.outputs[0].token_ids) == 3
        assert [lr.lora_name for lr in llm.list_loras()] == ["pirate"]
    finally:
        llm.shutdown()
