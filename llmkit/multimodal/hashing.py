"""Content hashes of images: the same pixels give the same hash in every process (sha256,
never Python's seeded ``hash()``), different pixels, sizes or modes a different one."""
from __future__ import annotations

import hashlib

from PIL import Image


def hash_image(image: Image.Image) -> str:
    h = hashlib.sha256(b"llmkit.image.v1")
    h.update(image.mode.encode())
    h.update(b"|%d|%d|" % image.size)
    h.update(image.tobytes())
    return h.hexdigest()[:32]
