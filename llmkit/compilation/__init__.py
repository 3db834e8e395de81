"""Step graphs (group ``compilation``): compiled decode steps on CPUs, CUDA graphs on GPUs;
``base.py`` holds the interface, the platform picks the implementation."""
from llmkit.compilation.base import StepGraphs

__all__ = ["StepGraphs"]
