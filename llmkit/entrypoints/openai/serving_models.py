"""The models a server answers for: the base model (under its names) and its LoRA adapters
(vLLM's ``OpenAIServingModels``).

A request's ``model`` picks one: a base name runs the base model, an adapter's name runs that
adapter, anything else is a 404 in OpenAI's shape. Adapters come from ``lora.modules`` (ids 1,
2, ... in order: the engine core registered the same ids at start) and, with
``lora.allow_runtime_updates``, from ``POST /v1/load_lora_adapter``; each runtime load gets a
fresh id, never reused, so KV blocks cached for an unloaded adapter can never serve another.

Runtime loads read only under ``lora.allowed_paths``: a path with a ``..`` component, or whose
real path (symlinks resolved) is not inside an allowed folder, is refused with 403 before
anything is read or registered. No allowed folder means every runtime load is refused.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmkit.config.schema import LoRAConfig
from llmkit.engine.async_llm import AsyncLLM, EngineDeadError
from llmkit.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead
from llmkit.entrypoints.openai.protocol import ModelCard, ModelList, SamplingDefaults
from llmkit.lora.adapters import configured_adapters, runtime_adapter_ids
from llmkit.lora.request import LoRARequest
from llmkit.sampling.params import SamplingParams


def sampling_defaults(model_fields: dict[str, Any]) -> SamplingDefaults:
    """The values a request that leaves a field out gets (``to_sampling_params``' rule):
    the model's ``model_fields`` (``AsyncLLM.default_sampling_fields``) over
    ``SamplingParams``' defaults."""
    base = SamplingParams()
    values = {name: model_fields.get(name, getattr(base, name))
              for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    return SamplingDefaults(**values, max_tokens=model_fields.get("max_tokens"),
                            from_model=sorted(model_fields))


class ServingModels:
    def __init__(self, engine: AsyncLLM, base_names: list[str], lora: LoRAConfig) -> None:
        self.engine = engine
        self.base_names = base_names
        self.base_name = base_names[0]
        self.lora_config = lora
        # the engine registers these under the same ids (llmkit/lora/adapters.py)
        self.adapters: dict[str, LoRARequest] = {lr.lora_name: lr
                                                 for lr in configured_adapters(lora)}
        self._ids = runtime_adapter_ids(lora)

    # -- requests ---------------------------------------------------------------------------
    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 otherwise."""
        if name is None or name in self.base_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        served = ", ".join(f"`{n}`" for n in [self.base_name, *self.adapters])
        raise OpenAIError(404, f"The model `{name}` does not exist. This server serves "
                               f"{served}.", param="model", code="model_not_found")

    def list_models(self) -> ModelList:
        root = str(self.engine.model_source.path)
        defaults = sampling_defaults(self.engine.default_sampling_fields)
        cards = [ModelCard(id=self.base_name, root=root, max_model_len=self.engine.max_model_len,
                           sampling_defaults=defaults)]
        cards += [ModelCard(id=lr.lora_name, root=lr.lora_path, parent=self.base_name,
                            max_model_len=self.engine.max_model_len,
                            sampling_defaults=defaults)
                  for lr in self.adapters.values()]
        return ModelList(data=cards)

    def retrieve(self, name: str) -> ModelCard:
        """``GET /v1/models/{model}`` (OpenAI's retrieve): the card of a base name (any of
        its aliases) or an adapter; 404 in OpenAI's shape otherwise."""
        adapter = self.resolve(name)
        cards = self.list_models().data
        return cards[0] if adapter is None else next(c for c in cards if c.id == name)

    # -- runtime updates --------------------------------------------------------------------
    def check_path(self, lora_path: str) -> str:
        """The real path of ``lora_path`` if it lies under ``lora.allowed_paths``, else 403."""
        if ".." in Path(lora_path).parts:
            raise OpenAIError(403, f"lora_path {lora_path!r} contains '..'; give a path inside "
                                   "lora.allowed_paths", type="permission_error",
                              param="lora_path", code="path_not_allowed")
        real = Path(os.path.realpath(lora_path))
        for folder in self.lora_config.allowed_paths:
            if real.is_relative_to(os.path.realpath(folder)):
                return str(real)
        allowed = ", ".join(self.lora_config.allowed_paths) or "none are configured"
        raise OpenAIError(403, f"lora_path {lora_path!r} is not inside lora.allowed_paths "
                               f"({allowed})", type="permission_error", param="lora_path",
                          code="path_not_allowed")

    async def load(self, lora_name: str, lora_path: str) -> str:
        if not lora_name:
            raise bad_request("lora_name must be a non-empty string", "lora_name")
        path = self.check_path(lora_path)
        if lora_name in self.adapters or lora_name in self.base_names:
            raise bad_request(f"The lora adapter '{lora_name}' has already been loaded.",
                              "lora_name")
        request = LoRARequest(lora_name, next(self._ids), path)
        try:
            await self.engine.add_lora(request)
        except EngineDeadError as e:
            raise engine_dead(e) from None
        except ValueError as e:
            raise bad_request(f"cannot load the lora adapter '{lora_name}': {e}",
                              "lora_path") from None
        self.adapters[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload(self, lora_name: str) -> str:
        request = self.adapters.get(lora_name)
        if request is None:
            raise OpenAIError(404, f"The lora adapter '{lora_name}' cannot be found.",
                              param="lora_name", code="model_not_found")
        # Gone for new requests at once; the engine forgets it when its requests are done.
        del self.adapters[lora_name]
        try:
            await self.engine.remove_lora(request.lora_int_id)
        except EngineDeadError as e:
            raise engine_dead(e) from None
        return f"Success: LoRA adapter '{lora_name}' removed successfully."
