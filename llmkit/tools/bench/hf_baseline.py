"""The Hugging Face ``transformers`` baseline: ``model.generate`` on the same model, prompts and
lengths, batched as its users would batch it.

- the same weights (the HF folder, or the GGUF through transformers' ``gguf_file``), the
  engine's dtype, ``attn_implementation="sdpa"`` (transformers' default), the same torch thread
  count;
- the exact prompt token ids llmkit ran, sorted by length into batches of up to
  ``batch_size`` (32), padded on the left with an attention mask;
- each batch runs to its longest ``max_tokens`` (``min_new_tokens`` equal to it when llmkit
  ignores EOS, as ``bench.ignore_eos`` does by default); only each prompt's own ``max_tokens``
  (or its tokens up to EOS) count as output;
- greedy when the temperature is 0, else sampling at that temperature;
- one untimed warm-up batch first, as llmkit gets one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["HFResult", "load_hf_model", "make_batches", "run_hf_generate"]


@dataclass(slots=True)
class HFResult:
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # counted per prompt: its own max_tokens (or up to EOS)
    generated_tokens: int  # what generate computed, padding rows of each batch included
    num_batches: int
    batch_size: int
    dtype: str
    num_threads: int
    attn_implementation: str = "sdpa"

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["request_throughput"] = self.request_throughput
        d["output_throughput"] = self.output_throughput
        d["total_token_throughput"] = ((self.prompt_tokens + self.output_tokens) / self.elapsed_s
                                       if self.elapsed_s > 0 else 0.0)
        return d


def make_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices sorted by prompt length (stable), cut into batches of at most ``batch_size``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def load_hf_model(model_path: str | Path, dtype, attn_implementation: str = "sdpa",
                  device: Any = None):
    """``AutoModelForCausalLM`` from an HF folder or a ``.gguf`` file, in ``dtype``, on
    ``device`` (default: the CPU), eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    if path.is_file() and path.suffix.lower() == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()


def _count_own(row: list[int], max_tokens: int, eos_ids: set[int], ignore_eos: bool) -> int:
    row = row[:max_tokens]
    if ignore_eos:
        return len(row)
    for i, t in enumerate(row):
        if t in eos_ids:
            return i + 1
    return len(row)


def run_hf_generate(model: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], *,
                    pad_token_id: int, eos_token_ids: Sequence[int] = (),
                    ignore_eos: bool = True, temperature: float = 0.0, batch_size: int = 32,
                    num_threads: int | None = None, warmup: bool = True,
                    progress: bool = False) -> HFResult:
    """Time ``model.generate`` over ``prompts`` (token ids), batched as described above."""
    import torch

    if len(prompts) != len(max_tokens):
        raise ValueError("one max_tokens per prompt")
    if num_threads:
        torch.set_num_threads(num_threads)
    device = next(model.parameters()).device
    eos = set(int(t) for t in eos_token_ids)

    def generate(idx: list[int], new: int | None = None) -> tuple[list[list[int]], int]:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = list(prompts[i])
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        new = new or max(max_tokens[i] for i in idx)
        kwargs: dict[str, Any] = {"max_new_tokens": new, "pad_token_id": pad_token_id}
        if ignore_eos:
            kwargs["min_new_tokens"] = new
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        gen = out[:, width:].tolist()
        return gen, out.shape[0] * (out.shape[1] - width)

    batches = make_batches([len(p) for p in prompts], batch_size)
    if warmup and batches:
        generate(batches[0][:1], new=min(4, max_tokens[batches[0][0]]))  # untimed warm-up
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(prompts), desc="hf generate", unit="req")
    out_tokens = generated = 0
    t0 = time.perf_counter()
    for idx in batches:
        gen, computed = generate(idx)
        generated += computed
        for row, i in enumerate(idx):
            out_tokens += _count_own(gen[row], max_tokens[i], eos, ignore_eos)
        if bar is not None:
            bar.update(len(idx))
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return HFResult(elapsed_s=elapsed, num_requests=len(prompts),
                    prompt_tokens=sum(len(p) for p in prompts), output_tokens=out_tokens,
                    generated_tokens=generated, num_batches=len(batches),
                    batch_size=batch_size, dtype=str(next(model.parameters()).dtype),
                    num_threads=torch.get_num_threads(),
                    attn_implementation=str(getattr(model.config, "_attn_implementation",
                                                    "sdpa")))
