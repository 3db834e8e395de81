"""What the tests share: tiny models and adapters, references, fakes, the server harness.

Test modules import these (``from helpers.tiny_models import build_model_dir``) and never one
another; pytest puts ``tests/`` on the import path (``pythonpath`` in pyproject.toml).
"""
