import sys
from pathlib import Path

# Benchmarks import their helpers (the vendored scheduler trace) by plain module name.
sys.path.insert(0, str(Path(__file__).parent))
