"""llmkit: LLM inference and serving from swappable components assembled by config."""
from llmkit.outputs import CompletionOutput, Logprob, RequestOutput
from llmkit.sampling.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "LoRARequest", "BeamSearchParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; load it only when asked for.
    if name == "LLM":
        from llmkit.engine.llm import LLM
        return LLM
    if name == "LoRARequest":
        from llmkit.lora.request import LoRARequest
        return LoRARequest
    if name == "BeamSearchParams":
        from llmkit.engine.beam_search import BeamSearchParams
        return BeamSearchParams
    raise AttributeError(f"module 'llmkit' has no attribute {name!r}")
