"""What identifies KV: the model's weights and config and the KV format. KV is loaded only
where the fingerprint matches, so a different model (or dtype, or block size) never reads
another's blocks from a shared folder."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

#: Bytes read from each end of every weight file: enough to tell checkpoints apart without
#: hashing gigabytes at start-up (the size is hashed too).
SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weights_digest(model_path: str | Path) -> str:
    """sha256 over each weight file's name, size and first and last MiB, and the folder's
    ``config.json``; a ``.gguf`` path is its own weight file."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                fh.seek(size - SAMPLE_BYTES)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def kv_fingerprint(model_path: str | Path, **kv_format: Any) -> str:
    """The fingerprint of KV computed by the model at ``model_path`` in ``kv_format`` (dtype,
    block size, block shape, number of layers, ...): 32 hex digits."""
    h = hashlib.sha256(weights_digest(model_path).encode())
    h.update(json.dumps(kv_format, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]
