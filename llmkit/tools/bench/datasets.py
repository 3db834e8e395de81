"""Workloads: which prompts, how many output tokens, and when each request arrives.

``build_workload(bench_cfg, tokenizer) -> list[WorkloadRequest]`` is pure (no network, no
clock): the same config, seed and tokenizer give the same requests, so the HTTP load generator,
the offline benchmarks and the simulator all replay one workload.

Datasets (``bench.dataset``):

- ``random``: prompts of random token ids (special tokens excluded), lengths uniform in
  ``input_len * [1 - range_ratio, 1 + range_ratio]``; output lengths likewise from
  ``output_len``.
- ``shared_prefix``: ``num_prefixes`` random prefixes of ``prefix_len`` tokens; request ``i``
  is prefix ``i % num_prefixes`` followed by its own random suffix (length from
  ``input_len``) — a prefix-caching workload.
- ``jsonl``: ``dataset_path``, one ``{"prompt": str | [token ids], "max_tokens": int}`` per
  line (``max_tokens`` defaults to ``output_len``); the first ``num_requests`` lines.

``lora_names`` spreads the requests over LoRA adapters: request ``i`` (in arrival order) runs
with ``lora_names[i % len(lora_names)]`` (sent as its ``model``; offline, the ``lora.modules``
adapter of that name).

``prompt_format=text`` turns token-id prompts into text (decoded, then re-encoded to count its
tokens) for servers that accept only text.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from llmkit.tools.bench.arrivals import arrival_times

if TYPE_CHECKING:
    from llmkit.tools.schema import BenchConfig

__all__ = ["DATASETS", "WorkloadError", "WorkloadRequest", "build_workload", "load_jsonl",
           "random_lengths"]

DATASETS = ("random", "shared_prefix", "jsonl")


class WorkloadError(ValueError):
    """A workload that cannot be built from the config (a bad dataset file, no tokenizer)."""


class TokenizerLike(Protocol):
    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload. It is sent as ``prompt`` (text) when that is set, else as
    ``prompt_token_ids``; ``prompt_len`` is its length in tokens (``None`` when unknown: a
    text prompt and no tokenizer)."""

    request_id: str
    max_tokens: int
    arrival_s: float = 0.0
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    prompt_len: int | None = None
    # shared_prefix: which prefix the prompt starts with
    prefix_id: int | None = None
    # bench.lora_names: the LoRA adapter (served name) this request runs with; None = base
    lora_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def payload_prompt(self) -> str | list[int]:
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or [])


def random_lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _token_pool(tokenizer: TokenizerLike) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = [t for t in range(len(tokenizer)) if t not in special]
    if not pool:
        raise WorkloadError("the tokenizer has no ordinary tokens to build random prompts from")
    return pool


def _need_tokenizer(tokenizer: TokenizerLike | None, dataset: str) -> TokenizerLike:
    if tokenizer is None:
        raise WorkloadError(f"bench.dataset={dataset} needs a tokenizer: give MODEL (or "
                         "model.path=...) or bench.tokenizer=PATH")
    return tokenizer


def _random_dataset(cfg: Any, tokenizer: TokenizerLike, rng: random.Random
                    ) -> list[WorkloadRequest]:
    pool = _token_pool(tokenizer)
    n = cfg.num_requests
    in_lens = random_lengths(rng, n, cfg.input_len, cfg.range_ratio)
    out_lens = random_lengths(rng, n, cfg.output_len, cfg.range_ratio)
    return [WorkloadRequest(f"bench-{i}", out_lens[i],
                            prompt_token_ids=rng.choices(pool, k=in_lens[i]),
                            prompt_len=in_lens[i])
            for i in range(n)]


def _shared_prefix_dataset(cfg: Any, tokenizer: TokenizerLike, rng: random.Random
                           ) -> list[WorkloadRequest]:
    pool = _token_pool(tokenizer)
    prefixes = [rng.choices(pool, k=cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    n = cfg.num_requests
    suffix_lens = random_lengths(rng, n, cfg.input_len, cfg.range_ratio)
    out_lens = random_lengths(rng, n, cfg.output_len, cfg.range_ratio)
    reqs = []
    for i in range(n):
        k = i % cfg.num_prefixes
        ids = prefixes[k] + rng.choices(pool, k=suffix_lens[i])
        reqs.append(WorkloadRequest(f"bench-{i}", out_lens[i], prompt_token_ids=ids,
                                    prompt_len=len(ids), prefix_id=k))
    return reqs


def load_jsonl(path: str | Path, limit: int | None = None, default_max_tokens: int = 64
               ) -> list[tuple[str | list[int], int]]:
    """``(prompt, max_tokens)`` pairs from a JSONL file; errors name the line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise WorkloadError(f"bench.dataset_path {str(path)!r} does not exist")
    out: list[tuple[str | list[int], int]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise WorkloadError(f'{where}: expected {{"prompt": ..., "max_tokens": N}}')
            prompt = row["prompt"]
            ok_ids = isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not ok_ids:
                raise WorkloadError(f"{where}: prompt must be a non-empty string or a list of "
                                 "token ids")
            max_tokens = row.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise WorkloadError(f"{where}: max_tokens must be an integer >= 1, got "
                                 f"{max_tokens!r}")
            out.append((prompt, max_tokens))
    if not out:
        raise WorkloadError(f"{path}: no requests in the file")
    return out


def _jsonl_dataset(cfg: Any, tokenizer: TokenizerLike | None) -> list[WorkloadRequest]:
    if not cfg.dataset_path:
        raise WorkloadError("bench.dataset=jsonl needs bench.dataset_path=FILE")
    reqs = []
    for i, (prompt, max_tokens) in enumerate(
            load_jsonl(cfg.dataset_path, cfg.num_requests, cfg.output_len)):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=False) if tokenizer else None
            reqs.append(WorkloadRequest(f"bench-{i}", max_tokens, prompt_token_ids=ids,
                                        prompt=prompt, prompt_len=len(ids) if ids else None))
        else:
            reqs.append(WorkloadRequest(f"bench-{i}", max_tokens, prompt_token_ids=list(prompt),
                                        prompt_len=len(prompt)))
    return reqs


def _as_text(reqs: list[WorkloadRequest], tokenizer: TokenizerLike | None) -> None:
    for r in reqs:
        if r.prompt is not None or r.prompt_token_ids is None:
            continue
        tok = _need_tokenizer(tokenizer, "...prompt_format=text")
        r.prompt = tok.decode(r.prompt_token_ids)
        r.prompt_token_ids = tok.encode(r.prompt, add_special_tokens=False)
        r.prompt_len = len(r.prompt_token_ids)


def build_workload(cfg: BenchConfig, tokenizer: TokenizerLike | None = None
                   ) -> list[WorkloadRequest]:
    """The requests of ``cfg`` with their arrival times, in arrival order."""
    rng = random.Random(f"dataset-{cfg.seed}")
    if cfg.dataset == "random":
        reqs = _random_dataset(cfg, _need_tokenizer(tokenizer, cfg.dataset), rng)
    elif cfg.dataset == "shared_prefix":
        reqs = _shared_prefix_dataset(cfg, _need_tokenizer(tokenizer, cfg.dataset), rng)
    elif cfg.dataset == "jsonl":
        reqs = _jsonl_dataset(cfg, tokenizer)
    else:
        raise WorkloadError(f"bench.dataset must be one of {', '.join(DATASETS)}, got "
                         f"{cfg.dataset!r}")
    if cfg.prompt_format == "text":
        _as_text(reqs, tokenizer)
    for r, t in zip(reqs, arrival_times(len(reqs), cfg.rate, cfg.arrival, seed=cfg.seed)):
        r.arrival_s = t
    names = cfg.lora_names
    for i, r in enumerate(reqs):  # round robin over the adapters, in arrival order
        r.lora_name = names[i % len(names)] if names else None
    return reqs
