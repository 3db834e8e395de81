"""Where llmkit keeps what it builds and fetches: one cache folder, one environment variable.

``$LLMKIT_CACHE`` (default ``~/.cache/llmkit``) holds the default model's file
(``packages/``), converted GGUF tokenizers and configs (``gguf/``), the built C++ CPU kernels
(``cpu_kernels/``, each build with its dispatch calibration) and ``llmkit sim calibrate``'s
profile (``hardware/``). ``LLMKIT_CACHE_DIR``, the kernels' old name for it, is still read,
with a deprecation warning.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir"]

CACHE_ENV = "LLMKIT_CACHE"
_DEPRECATED_ENV = "LLMKIT_CACHE_DIR"


def cache_dir() -> Path:
    """llmkit's cache folder: ``$LLMKIT_CACHE``, else ``~/.cache/llmkit``."""
    root = os.environ.get(CACHE_ENV)
    if not root and os.environ.get(_DEPRECATED_ENV):
        root = os.environ[_DEPRECATED_ENV]
        # FutureWarning, not DeprecationWarning: users of the CLI should see it (Python hides
        # DeprecationWarning outside __main__); the warnings module shows it once.
        warnings.warn(f"{_DEPRECATED_ENV} is deprecated; set {CACHE_ENV} instead "
                      "(llmkit's one cache folder)", FutureWarning, stacklevel=2)
    return Path(root or "~/.cache/llmkit").expanduser()
