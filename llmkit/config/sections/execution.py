"""How a step computes: the attention backend, the sampler and its grammars, the executor and
the model's split over workers, and step graphs."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmkit.config.sections.strict import _Component, _Strict

__all__ = [
    "AttentionConfig", "CompilationConfig", "ExecutorConfig", "ParallelConfig", "SamplerConfig",
    "StructuredOutputConfig",
]


class AttentionConfig(_Component):
    # auto = the platform's default backend (triton on CUDA, torch on the CPU)
    name: str = "auto"


class SamplerConfig(_Component):
    name: str = "torch"


class StructuredOutputConfig(_Component):
    """Grammar-constrained decoding (``SamplingParams.structured_outputs``, the server's
    ``response_format``, ``structured_outputs`` and forced tool calls)."""

    name: str = "xgrammar"
    # JSON outputs without free whitespace between tokens (vLLM's disable_any_whitespace):
    # fewer tokens, and a weak model cannot wander off into endless spaces.
    disable_any_whitespace: bool = False
    # Threads compiling grammars in the background; 0 = half the CPU cores (at least 1).
    max_compile_threads: int = Field(default=0, ge=0)
    # Compiled grammars kept for reuse, keyed by the spec (least recently used go first).
    cache_size: int = Field(default=256, ge=1)


class ExecutorConfig(_Component):
    # auto: uniproc for one worker, multiproc for several (parallel.*); ray: Ray actors
    name: str = "auto"
    # executor=ray: the address of an existing Ray cluster (ray.init's); null = start a local one
    ray_address: str | None = None


class ParallelConfig(_Strict):
    """How the model is split over workers (the seed's chapter 08; vLLM's names). One worker
    per rank: ``tensor_parallel_size * pipeline_parallel_size`` of them."""

    # tensor parallel: every layer split by heads / rows over this many ranks
    tensor_parallel_size: int = Field(default=1, ge=1)
    # pipeline parallel: the layers split into this many stages
    pipeline_parallel_size: int = Field(default=1, ge=1)
    # data parallel: this many engine cores behind one front end
    data_parallel_size: int = Field(default=1, ge=1)
    # MoE models: experts split over the ranks instead of every expert split by rows
    enable_expert_parallel: bool = False
    # torch.distributed's backend; auto = gloo on CPU, nccl on CUDA
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # CPU worker processes (executor=multiproc): auto = bind each rank to its own slice of the
    # usable cores when every rank gets at least one (threads stay on their rank's cores);
    # none = leave them to the OS (a machine shared with other jobs may do better unbound).
    cpu_binding: Literal["auto", "none"] = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class CompilationConfig(_Strict):
    """Step graphs (``llmkit/compilation/``): decode steps run as a compiled graph (CPU:
    ``torch.compile`` with the C++ kernels as opaque ops) or a captured CUDA graph, one per
    batch-size bucket; every other step, and ``mode=eager`` always, runs the eager model (the
    reference)."""

    # graphs = where the platform supports them (the default; conf/compilation/default.yaml
    # reads LLMKIT_COMPILATION_MODE for it, which the test suite sets to eager)
    mode: Literal["eager", "graphs"] = "graphs"
    # CUDA: the batch sizes to capture (null = 1, 2, 4, 8, then multiples of 8 up to 256 and
    # max_num_seqs); a decode step runs the smallest captured size >= its rows, padded.
    cudagraph_capture_sizes: list[int] | None = None
    # Where compiled graphs are cached (null = <llmkit cache>/compile): inductor's code cache,
    # and under step_graphs/ the CPU graphs saved whole, which a later start loads instead of
    # tracing the model again (keyed by the model's structure, options, torch and kernels).
    cache_dir: str | None = None
    # CPU: inductor's C++ wrapper (the graph's op calls from C++, not Python): ~3x less
    # overhead per op, a longer first compile.
    cpp_wrapper: bool = True
    # Graphs that must be compiled (none saved in cache_dir fits) compile on a background
    # thread while decode steps run eagerly, and are swapped in when ready (a cold CPU start
    # would otherwise wait minutes); false: the start waits for them (benchmarks that time
    # the graphs from the first step; the test suite, through LLMKIT_COMPILATION_BACKGROUND).
    # Saved graphs load before serving either way (seconds).
    background: bool = True
    # false: graphs that are not saved are not compiled at all (decode steps stay eager);
    # `llmkit generate` sets it, as a one-shot run ends long before a compile would, and the
    # compile would only slow it down. chat and serve compile them, for every later start.
    compile_missing: bool = True
