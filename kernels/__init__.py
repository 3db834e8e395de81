"""Triton kernels and their torch references, installed as ``llmkit.kernels``."""
