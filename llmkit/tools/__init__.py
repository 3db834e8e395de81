"""The tools beside the engine: ``bench`` (load generator, offline benchmarks, metrics),
``sim`` (the engine's scheduler and KV cache on modelled hardware), ``plan`` (a recipe for a
workload and an SLO, searched in the simulator), ``eval`` (perplexity) and ``proxy`` (the front
of disaggregated serving).

They drive the engine from outside, through its public API (``llmkit.engine.llm.LLM``, the
config, ``SamplingParams``, outputs) and its step observers
(``llmkit.engine.observe.observer``); the engine imports nothing of them
(``tests/test_layering.py`` enforces both). The ``llmkit bench``, ``sim``, ``plan``, ``eval`` and
``proxy`` commands compose the tools' config root, ``conf/tools/``.
"""
