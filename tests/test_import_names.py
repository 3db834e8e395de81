"""The fixed layout's top-level ``kernels/`` folder (installed as ``llmkit.kernels``) shadows the
hub's ``kernels`` package, which transformers >= 5.25 imports, in any Python started in a clone's
root (``python -m pytest``, ``python -m llmkit``): it must hand that name over."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_kernels_from_the_root() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import kernels, llmkit.kernels as k; "
                           "print(kernels.__file__); print(k.__file__)"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_top_level_kernels_name_is_the_hub_package_or_absent():
    out = _import_kernels_from_the_root()
    try:
        importlib.metadata.distribution("kernels")
        hub_installed = True
    except importlib.metadata.PackageNotFoundError:
        hub_installed = False
    if hub_installed:
        assert out.returncode == 0, out.stderr
        hub_file, ours = out.stdout.split()
        assert not Path(hub_file).is_relative_to(REPO), hub_file
        assert Path(ours).is_relative_to(REPO / "kernels")
    else:
        assert out.returncode != 0
        assert "No module named 'kernels' (this folder is llmkit.kernels)" in out.stderr


def test_transformers_modeling_imports_from_the_root():
    out = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
