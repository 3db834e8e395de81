"""What the engine shows of itself: ``observer`` (the step observer API: ``StepEvent``,
``StepObserver``; what tools see), ``step_trace`` (the Chrome-trace file of every step),
``step_summary`` (the core process's rate-limited per-step summaries for live views, and
``EngineStepFeed``: those summaries as the API process keeps them) and ``stat_logger`` (the hooks
``AsyncLLM`` reports metrics through). Keep torch out of them: the engine core process imports
``step_summary`` before torch loads (``tests/test_layering.py``)."""
