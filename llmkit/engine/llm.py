"""The offline API: ``LLM(model).generate(prompts, params)`` with an in-process engine core."""
from __future__ import annotations

import itertools
from typing import Any, Iterator, Mapping, Sequence

from tqdm.auto import tqdm

from llmkit.config.compose import build_config
from llmkit.config.openmp_env import warn_if_threads_spin
from llmkit.config.schema import EngineConfig
from llmkit.engine.beam_search import (BeamSearchOutput, BeamSearchParams, first_logprobs,
                                       run_beam_search, start_beam_search)
from llmkit.engine.client import SteppedEngineClient
from llmkit.engine.loop.core import EngineCore
from llmkit.engine.frontend import Frontend, FrontendModel, Message, PromptType
from llmkit.engine.output_processor import RequestOutputKind
from llmkit.lora.request import LoRARequest
from llmkit.outputs import EmbeddingRequestOutput, RequestOutput
from llmkit.sampling.params import SamplingParams


class LLM:
    """An engine in this process for batch generation (with
    ``parallel.data_parallel_size > 1``: that many engine core processes behind a router).
    ``llm.engine`` is a ``SteppedEngineClient`` (``llmkit.engine.client``): the
    ``EngineCore``, or a ``DataParallelEngine``; requests reach it through ``llm.frontend``.

    ``LLM(model, dtype=..., overrides=[...], scheduler={...}, attention="torch", ...)``: ``model``
    is a preset name or a path (HF folder or .gguf); each keyword names a config group, a
    ``str`` picks its implementation and a ``dict`` sets its fields. Bad values raise
    ``ConfigError`` naming the key.

    ``sampling_params=None`` means the model's recommended defaults
    (``get_default_sampling_params()``, from ``model.generation_config``), as in vLLM.
    """

    def __init__(self, model: str | None = None, *, dtype: str | None = None,
                 overrides: Sequence[str] = (),
                 quantization: str | None = None, **groups: str | dict) -> None:
        config = build_config(model, dtype=dtype, overrides=overrides, groups=groups,
                              quantization=quantization)
        self._init_from_config(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._init_from_config(config)
        return llm

    def _init_from_config(self, config: EngineConfig) -> None:
        model = FrontendModel.load(config.model)
        self.config = config
        self.engine: SteppedEngineClient
        if config.parallel.data_parallel_size > 1:
            # N engine core processes behind a router (dp/engine.py).
            from llmkit.engine.dp.engine import DataParallelEngine
            self.engine = DataParallelEngine(config)
        else:
            core = EngineCore(config, model_source=model.source)
            # This process computes, and llmkit loaded torch before it could set the wait
            # policy (llmkit.config.openmp_env): say what the user must export. The sim
            # executor computes nothing.
            warn_if_threads_spin(core.platform.device.type == "cpu"
                                 and config.executor.name != "sim")
            self.engine = core
        self.frontend = Frontend(config, model, self.engine.model_facts)
        self.tokenizer = model.tokenizer
        self.model_source = model.source
        self.default_sampling_fields = model.default_sampling_fields
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` means: the model's recommended defaults
        (``model.generation_config``) over ``SamplingParams``' own. Change a field with
        ``dataclasses.replace(llm.get_default_sampling_params(), max_tokens=64)``."""
        return self.frontend.default_sampling_params()

    @property
    def max_model_len(self) -> int:
        return self.engine.model_facts.max_model_len

    # -- requests --------------------------------------------------------------------------
    def _add(self, prompt: PromptType, params: SamplingParams | None, kind: RequestOutputKind,
             lora_request: LoRARequest | None = None) -> str:
        """``params=None``: a pooling request (``embed``)."""
        p = (self.frontend.process_embedding(prompt) if params is None
             else self.frontend.process(prompt, params))
        lora_id = None
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest or None, got "
                                f"{type(lora_request).__name__}")
            self.engine.add_lora(lora_request)  # loads and checks it the first time
            lora_id = lora_request.lora_int_id
        rid = str(next(self._ids))
        engine = self.engine
        # The n samples go together (data parallel: to one engine core). The EOS id is a
        # start-up fact: the front end's copy, not a walk through the engine to its executor.
        engine.add_requests([p.to_request(child_id, child_params,
                                          eos_token_id=self.frontend.facts.eos_token_id,
                                          arrival_time=engine.clock(), lora_id=lora_id)
                             for child_id, child_params in self.frontend.fan_out(rid, p, kind)])
        return rid

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one per prompt (``None`` = the
        base model); an adapter is loaded (and checked) the first time it is named."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.frontend.default_sampling_params()
        n = len(prompt_list)
        params = _one_per_prompt(sampling_params, SamplingParams, n, "SamplingParams")
        loras = _one_per_prompt(lora_request, LoRARequest, n, "LoRA requests",
                                " (None = the base model)")
        rids: list[str] = []
        try:
            for p, sp, lr in zip(prompt_list, params, loras):
                rids.append(self._add(p, sp, RequestOutputKind.FINAL_ONLY, lr))
        except BaseException:
            self.abort(rids)  # nothing of a refused batch runs
            raise
        return self._run_to_completion(rids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``), pooled as the model says
        (``model.runner=pooling``; a generating engine raises ``ValueError``)."""
        prompt_list = _as_prompt_list(prompts)
        loras = _one_per_prompt(lora_request, LoRARequest, len(prompt_list), "LoRA requests",
                                " (None = the base model)")
        rids: list[str] = []
        try:
            for p, lr in zip(prompt_list, loras):
                rids.append(self._add(p, None, RequestOutputKind.FINAL_ONLY, lr))
        except BaseException:
            self.abort(rids)
            raise
        return self._run_to_completion(rids, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [self.frontend.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    *, use_tqdm: bool = False, lora_request: LoRARequest | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (``llmkit.engine.beam_search``): per prompt, the best
        ``params.beam_width`` sequences (prompt tokens included), best first."""
        searches = [start_beam_search(self.frontend, p, params)
                    for p in _as_prompt_list(prompts)]
        step = params.step_params(self.engine.model_facts.vocab_size)

        def run_step(batch: list[PromptType]) -> list:
            outs = self.generate(batch, step, use_tqdm=False, lora_request=lora_request)
            return [first_logprobs(o) for o in outs]

        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
            run_beam_search(searches, run_step, lambda: bar.update(1))
        return [s.output(self.tokenizer) for s in searches]

    # -- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (``generate`` also does on first use); False if it already is.
        Raises ``LoRALoadError`` (a ``ValueError``) for files that do not fit the model."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> list[int]:
        return self.frontend.apply_chat_template(messages, add_generation_prompt)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Generate one prompt, yielding each step's new text and tokens (delta outputs)."""
        if sampling_params is None:
            sampling_params = self.frontend.default_sampling_params()
        rid = self._add(prompt, sampling_params, RequestOutputKind.DELTA, lora_request)
        try:
            while True:
                for out in self._step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort([rid])

    def _step(self) -> list[RequestOutput]:
        """One engine step through the output processor. Requests the front end finished (a
        stop string matched) are aborted in the core at once, which frees their blocks."""
        stopped: list[str] = []
        outs = self.frontend.process_outputs(self.engine.step(), stopped)
        if stopped:
            self.engine.abort_requests(stopped)
        return outs

    def _run_to_completion(self, rids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(rids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(rids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(results) < len(wanted):
                for out in self._step():
                    if out.request_id in wanted and out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call: nothing of this batch keeps blocks.
            self.abort([r for r in rids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in rids]

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort user requests (all their samples when ``n > 1``)."""
        child_ids = [c for r in request_ids for c in self.frontend.child_request_ids(r)]
        if child_ids:
            self.frontend.process_outputs(self.engine.abort_requests(child_ids))

    def shutdown(self) -> None:
        self.engine.shutdown()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]  # one prompt (a dict prompt is one, not a list of its keys)
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one tokenized prompt
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, list, tuple, Mapping)):
            raise TypeError(f"prompts[{i}] must be a str, a list of token ids or a dict, "
                            f"got {type(p).__name__}")
    return [p if isinstance(p, (str, Mapping)) else list(p) for p in prompts]


def _one_per_prompt(value: Any, kind: type, n: int, noun: str, hint: str = "") -> list:
    """``value`` for each of ``n`` prompts: one ``kind`` (or None) for all of them, else a
    sequence of exactly one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {noun} for {n} prompts; pass one, or one per "
                         f"prompt{hint}")
    return values
