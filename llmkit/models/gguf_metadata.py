"""A ``.gguf`` file's config and tokenizer as transformers objects, converted once and cached.

Both come from transformers' GGUF support (``AutoConfig`` /
``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), which parses the whole vocabulary in
Python (seconds), so the results are saved in llmkit's cache folder, keyed by the file's path,
size and modification time, and read back from there on later runs. Beside the models (not in
the loader) because fetching the default model converts them too (``default_model``), and the
loader builds on the models package, not the other way round.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from llmkit.config.paths import cache_dir
from llmkit.startup import startup_step

logger = logging.getLogger(__name__)


def gguf_cache_folder(path: Path) -> Path:
    """Where the converted config and tokenizer of this GGUF file are kept."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def _cached(folder: Path, build: Callable[[Path], None], what: str) -> Path:
    """``folder``, built by ``build(tmp)`` into a temporary folder and renamed into place, so a
    reader never sees a half-written one and concurrent builders do not collide. ``what`` the
    build makes, for the start-up progress."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".tmp", dir=folder.parent))
    try:
        with startup_step(f"converting the {what} (once; cached)"):
            build(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
            # another process finished first: keep its copy
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_gguf_config(path: Path):
    """The transformers config of a GGUF file (with ``architectures`` filled in)."""
    from transformers import AutoConfig

    path = Path(path)
    folder = gguf_cache_folder(path) / "config"

    def build(tmp: Path) -> None:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        _fix_head_dim(config, path)
        if not getattr(config, "architectures", None):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            if arch:
                config.architectures = [arch]
        config.save_pretrained(str(tmp))
        (tmp / "source.json").write_text(json.dumps({"gguf": str(path.resolve())}))

    return AutoConfig.from_pretrained(str(_cached(folder, build, f"config of {path.name}")))


def _fix_head_dim(config, path: Path) -> None:
    """transformers reads the head size of llama/mistral files from ``rope.dimension_count``
    but of qwen2/qwen3 files not at all (leaving the config class's default, e.g. 128 for
    Qwen3); ``attention.key_length`` states it, when the file has it."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
        metadata, _ = read_gguf_metadata(str(path))
    except (ImportError, ValueError) as e:
        logger.debug("cannot read %s's metadata to check head_dim: %s", path, e)
        return
    key_length = metadata.get(f"{metadata['general.architecture']}.attention.key_length")
    if key_length and getattr(config, "head_dim", None) != key_length:
        config.head_dim = int(key_length)


def load_gguf_tokenizer(path: Path):
    """The tokenizer (with chat template) stored in a GGUF file."""
    from transformers import AutoTokenizer

    path = Path(path)
    folder = gguf_cache_folder(path) / "tokenizer"

    def build(tmp: Path) -> None:
        logger.info("converting the tokenizer of %s (once; cached in %s)", path, folder)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))

    return AutoTokenizer.from_pretrained(str(_cached(folder, build, f"tokenizer of {path.name}")))
