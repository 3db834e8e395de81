"""Simulation: llmkit's real scheduler and KV cache manager against a hardware cost model.

``llmkit sim [MODEL] hardware=NAME [key=value ...]`` replays a ``bench serve`` workload on a
virtual clock with ``executor=sim`` (no weights, no forward) and writes the same result JSON and
figure as ``bench serve``, marked ``"simulated": true``. Modules:

- ``model_shape``: parameters, layers, heads and KV bytes from an HF ``config.json``
  (named shapes in ``shapes/``);
- ``hardware``: profiles from ``conf/tools/hardware/`` (``HardwareProfile``);
- ``cost_model``: the step-time equations;
- ``executor``: ``SimExecutor``, the data plane that prices steps instead of running them;
- ``source``: which model is simulated (named shape, config.json, HF folder, .gguf) and its
  dtype; ``virtual_clock``, ``replay``: the simulation loop; ``cli``: the command;
- ``calibrate``: ``llmkit sim calibrate``; ``engine_measure`` + ``engine_fit``: ``llmkit sim
  calibrate engine`` (times the real engine's steps and fits the cost model's terms to them);
  ``gpu_check``: a device script that sets a GPU profile's predictions beside torch
  measurements (a validation, never a fit).

The executor is ``llmkit.tools.sim.executor.SimExecutor`` (``executor=sim``, registered through
the ``llmkit.executor`` entry point group in pyproject.toml). Modules here import nothing heavy
at import time (no torch): the cost model runs with the standard library (and PyYAML to read a
profile).
"""
