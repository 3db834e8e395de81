"""The test suite's helpers (``tests/helpers/``) for benchmark scripts run as
``python benchmarks/x.py``: Python puts the script's folder on the import path, not ``tests/``,
so this package lends its name to that folder (``from helpers.tiny_models import ...``) without
putting the test modules themselves within a benchmark's reach. Under pytest, ``pythonpath`` in
pyproject.toml finds ``tests/helpers`` directly."""
from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))
