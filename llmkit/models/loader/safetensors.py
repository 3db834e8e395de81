"""Weights of a Hugging Face model folder: ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The files holding the model's weights, in a stable order."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(absent)}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (llmkit reads "
                            "safetensors checkpoints, or a .gguf file)")


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every file, one file open at a time."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
