"""Multi-LoRA serving: PEFT adapters applied per request, rows of many adapters in one step.

``request.py`` (``LoRARequest``, ``LoRALoadError``: plain data, no torch), ``base.py`` (adapters, the step's row -> slot mapping), ``peft.py`` (loading
PEFT folders), ``layers.py`` (the LoRA linear method wrapping any base method; the embedding
wrapper), ``punica.py`` (the batched shrink/expand: torch, C++, Triton), ``manager.py`` (known /
loaded / resident adapters with LRU, and the per-step mapping).
"""
from llmkit.lora.request import LoRALoadError, LoRARequest

__all__ = ["LoRALoadError", "LoRARequest"]
