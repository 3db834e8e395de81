"""Beam search with vLLM's semantics, run by the front end over ordinary engine requests.

Each step submits every live beam (prompt + the beam's tokens so far) as a request of
``max_tokens=1`` with ``logprobs=2 * beam_width`` (Hugging Face's choice: 2k candidates
guarantee k that are not EOS). Re-submitting the whole prefix costs little: the prompt's and the
shared beam prefix's full KV blocks are prefix-cache hits (``kv_cache.enable_prefix_caching``),
so beams share those blocks rather than holding copies. Then, per prompt:

- every candidate ``(beam, token)`` gets ``cum_logprob = beam's + token's logprob``;
- a candidate ending in EOS (unless ``ignore_eos``) is *completed*, whatever its rank among the
  candidates (vLLM's rule; Hugging Face keeps only EOS candidates ranked in the top k);
- the other candidates, sorted by score, keep the best ``beam_width`` as the live beams;
- after ``max_tokens`` steps (or when no beam is live), the live beams join the completed ones
  and the best ``beam_width`` by score are the result, best first.

Score (``get_beam_search_score``): ``cum_logprob / len ** length_penalty``, where ``len`` counts
the prompt's tokens too and not a final EOS (vLLM's; Hugging Face counts the generated tokens).
With ``ignore_eos`` every result has the same length, so the order is by ``cum_logprob``: what
Hugging Face's ``generate(num_beams=k, do_sample=False)`` returns when no EOS is reachable.

``LLM.beam_search`` (offline, every prompt's beams batched per step) and
``AsyncLLM.beam_search`` (one prompt; its beams run as concurrent requests) drive the same
``BeamSearch`` state; ``/v1/completions`` with ``use_beam_search`` calls the latter.
"""
from __future__ import annotations

import asyncio
import logging
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmkit.outputs import CompletionOutput, Logprob, RequestOutput
from llmkit.sampling.params import SamplingParams

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "create_sort_beams_key_function", "first_logprobs", "get_beam_search_score",
           "run_beam_search", "run_beam_search_async", "start_beam_search"]

logger = logging.getLogger(__name__)

# One step's candidates of one beam: ``{token_id: Logprob}`` (None: the engine returned none).
StepLogprobs = Mapping[int, Logprob] | None


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, each up to ``max_tokens`` new tokens;
    ``temperature`` of the step requests (0: the candidates alone decide; the logprobs are the
    raw distribution's either way); ``length_penalty``: the exponent of the score's length;
    ``include_stop_str_in_output``: whether a server response's text and token ids keep the
    final EOS (``LLM.beam_search``'s sequences always do, as vLLM's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"BeamSearchParams.{name}: must be an integer >= 1, got {v!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
            raise ValueError(f"BeamSearchParams.temperature: must be a finite number >= 0, "
                             f"got {t!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, numbers.Real) or not math.isfinite(lp):
            raise ValueError(f"BeamSearchParams.length_penalty: must be a finite number, "
                             f"got {lp!r}")

    def step_params(self, vocab_size: int) -> SamplingParams:
        """What each beam's one-token request asks of the engine."""
        return SamplingParams(n=1, temperature=float(self.temperature), max_tokens=1,
                              logprobs=min(2 * self.beam_width, vocab_size), ignore_eos=True)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam (vLLM's): ``tokens`` are the prompt's then the beam's; ``logprobs`` one
    candidates dict per generated token; ``text`` is filled for the result only."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_id: int | None, length_penalty: float = 1.0) -> float:
    """``cumulative_logprob / len ** length_penalty``; ``len`` counts the prompt and not a
    final EOS (vLLM's, adapted from Hugging Face's)."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | None, length_penalty: float
                                   ) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)
    return sort_beams_key


class BeamSearch:
    """One prompt's search: its live beams and its completed ones (see the module docstring).
    ``prompts()`` are the step's requests, one per live beam; ``advance()`` takes their
    candidates in the same order."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_id: int | None, prompt_text: str | None = None,
                 cache_salt: str | None = None) -> None:
        self.params = params
        self.cache_salt = cache_salt
        self.eos_token_id = eos_token_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_text = prompt_text
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0
        self._key = create_sort_beams_key_function(eos_token_id, params.length_penalty)

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not self.beams

    def prompts(self) -> list[list[int] | dict[str, Any]]:
        """The step's prompts: each live beam's tokens (with the prompt's cache salt, which
        keeps its prefix-cache blocks among requests of the same salt)."""
        if self.cache_salt is None:
            return [b.tokens for b in self.beams]
        return [{"prompt_token_ids": b.tokens, "cache_salt": self.cache_salt}
                for b in self.beams]

    def advance(self, candidates: Sequence[StepLogprobs]) -> None:
        if len(candidates) != len(self.beams):
            raise ValueError(f"{len(candidates)} candidate sets for {len(self.beams)} beams")
        eos, stop_at_eos = self.eos_token_id, not self.params.ignore_eos
        live: list[BeamSearchSequence] = []
        for beam, cands in zip(self.beams, candidates):
            if cands is None:
                continue
            step = dict(cands)
            for token_id, lp in step.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [step],
                                         beam.cum_logprob + lp.logprob)
                if token_id == eos and stop_at_eos:
                    new.finish_reason, new.stop_reason = "stop", eos
                    self.completed.append(new)
                else:
                    live.append(new)
        live.sort(key=self._key, reverse=True)  # stable: ties keep the engine's order
        self.beams = live[:self.params.beam_width]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The result, best first (call when ``done``)."""
        ranked = sorted(self.completed + self.beams, key=self._key, reverse=True)
        return ranked[:self.params.beam_width]

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """``LLM.beam_search``'s result: sequences with the prompt, their text decoded whole."""
        best = self.best()
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)
            beam.finish_reason = beam.finish_reason or "length"
        return BeamSearchOutput(best)

    def request_output(self, request_id: str, tokenizer: Any) -> RequestOutput:
        """The server's shape: one finished ``RequestOutput``, a ``CompletionOutput`` per beam
        (best first) with the generated tokens only; a final EOS is left out of the text, and
        out of the token ids unless ``include_stop_str_in_output``."""
        start = len(self.prompt_token_ids)
        outs = []
        for i, beam in enumerate(self.best()):
            gen = beam.tokens[start:]
            stopped = beam.finish_reason == "stop"
            text = tokenizer.decode(gen[:-1] if stopped else gen, skip_special_tokens=True)
            if stopped and not self.params.include_stop_str_in_output:
                gen = gen[:-1]
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=gen, cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs[:len(gen)], finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason))
        return RequestOutput(request_id, self.prompt_text, self.prompt_token_ids, outs,
                             finished=True)


def start_beam_search(frontend: Any, prompt: Any, params: BeamSearchParams,
                      cache_salt: str | None = None) -> BeamSearch:
    """A prompt's search: the prompt (text, token ids or a dict without
    images) checked by the front end as ``generate`` checks it, and ``max_tokens`` against the
    model's context (``ValueError`` naming what is wrong). ``frontend``: a ``Frontend``."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    facts = frontend.facts
    p = frontend.process(prompt, params.step_params(facts.vocab_size), cache_salt=cache_salt)
    if p.mm_features:
        raise ValueError("beam search takes text or token-id prompts, not multi_modal_data")
    limit = facts.max_model_len
    if len(p.token_ids) + params.max_tokens > limit:
        raise ValueError(f"BeamSearchParams.max_tokens: the prompt's {len(p.token_ids)} tokens "
                         f"and max_tokens={params.max_tokens} exceed this model's context "
                         f"(model.max_model_len={limit})")
    if not frontend.config.kv_cache.enable_prefix_caching:
        logger.warning("beam search with kv_cache.enable_prefix_caching=false recomputes every "
                       "beam's whole prefix at every step")
    return BeamSearch(p.token_ids, params, facts.eos_token_id, p.text, p.cache_salt)


def first_logprobs(out: RequestOutput) -> StepLogprobs:
    """A step request's candidates: the logprobs of its one generated token."""
    lps = out.outputs[0].logprobs if out.outputs else None
    return lps[0] if lps else None


def run_beam_search(searches: Sequence[BeamSearch],
                    step: Callable[[list[Any]], list[StepLogprobs]],
                    on_step: Callable[[], None] | None = None) -> None:
    """Run the searches to the end, every live beam of every prompt in one batch per step:
    ``step(prompts)`` returns each prompt's candidates (``LLM.beam_search``)."""
    while live := [s for s in searches if not s.done]:
        batch = [p for s in live for p in s.prompts()]
        results = step(batch)
        start = 0
        for s in live:
            n = len(s.beams)
            s.advance(results[start:start + n])
            start += n
        if on_step is not None:
            on_step()


async def run_beam_search_async(search: BeamSearch,
                                step_one: Callable[[Any, int, int],
                                                   Awaitable[StepLogprobs]]) -> None:
    """Run one search to the end, each step's beams as concurrent requests:
    ``step_one(prompt, step, beam)`` returns a beam's candidates (``AsyncLLM.beam_search``)."""
    while not search.done:
        # A task group: one beam's failure cancels (and so aborts) the step's other requests.
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(step_one(p, search.num_steps, i))
                         for i, p in enumerate(search.prompts())]
        except ExceptionGroup as eg:  # callers handle the engine's own errors (bad input...)
            raise eg.exceptions[0] from None
        search.advance([t.result() for t in tasks])
