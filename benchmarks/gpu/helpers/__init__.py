"""The test suite's helpers (``tests/helpers/``) for ``python benchmarks/gpu/check_kernels.py``:
the script's folder is on the import path, so this package lends its name to that folder
(``from helpers.kernel_inputs import make_paged_batch``), as ``benchmarks/helpers/`` does for
the scripts one level up."""
from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[3] / "tests" / "helpers"))
