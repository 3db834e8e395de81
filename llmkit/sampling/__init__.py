"""Sampling parameters and samplers, picked by ``sampler.name``.

The sampler (torch) loads on first use, so that importing ``SamplingParams`` stays light.
"""
from llmkit.registry import Registry
from llmkit.sampling.params import SamplingParams, StructuredOutputsParams

SAMPLERS: Registry = Registry("sampler")
SAMPLERS.register_lazy("torch", "llmkit.sampling.sampler.TorchSampler")

_LAZY = {"Sampler", "SamplerOutput", "SamplingMetadata", "PenaltyInputs", "TorchSampler"}


def __getattr__(name: str):
    if name in _LAZY:
        from llmkit.sampling import sampler
        return getattr(sampler, name)
    raise AttributeError(f"module 'llmkit.sampling' has no attribute {name!r}")


__all__ = ["SAMPLERS", "SamplingParams", "StructuredOutputsParams", "Sampler", "SamplerOutput", "SamplingMetadata",
           "PenaltyInputs", "TorchSampler"]
