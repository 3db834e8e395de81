"""The runner's images: each request's multimodal features, the encoder cache (an image's
encoder output, by its identifier, until the scheduler frees it) and the step's
``inputs_embeds`` with the image placeholders' rows replaced."""
from __future__ import annotations

import numpy as np
import torch


class MultimodalInputs:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoder_runs = 0  # images encoded since start-up
        self._features: dict[str, list] = {}

    def __bool__(self) -> bool:
        """Whether any request in the batch has images."""
        return bool(self._features)

    def add_request(self, req_id: str, features: list | None) -> None:
        if features:
            self._features[req_id] = features

    def remove_request(self, req_id: str) -> None:
        self._features.pop(req_id, None)

    def free(self, identifiers) -> None:
        for h in identifiers:
            self.encoder_cache.pop(h, None)

    def encode(self, model: torch.nn.Module, scheduled: dict[str, list[int]]) -> None:
        """Encode the step's scheduled images (batched by pixel shape) into the cache."""
        by_shape: dict[tuple, dict] = {}
        for rid, input_ids in scheduled.items():
            features = self._features[rid]
            for i in input_ids:
                f = features[i]
                if f.identifier not in self.encoder_cache:
                    key = (tuple(f.shape), tuple(f.grid_thw))
                    by_shape.setdefault(key, {})[f.identifier] = f
        for (_, grid), group in by_shape.items():
            pixels = torch.cat([f.pixel_tensor() for f in group.values()]).to(self.device)
            # A patch-grid encoder (Qwen2-VL) takes the group's grid; a fixed-size one none.
            embeds = model.embed_multimodal(pixels, grid) if grid else \
                model.embed_multimodal(pixels)
            for f, e in zip(group.values(), embeds):
                if e.shape[0] != f.length:
                    raise RuntimeError(f"image {f.identifier}: the encoder gave {e.shape[0]} "
                                       f"embeddings for {f.length} placeholder tokens")
                self.encoder_cache[f.identifier] = e
            self.num_encoder_runs += len(group)

    def embeddings(self, model: torch.nn.Module, input_ids: torch.Tensor, req_ids: list[str],
                   computed: np.ndarray, num_scheduled: np.ndarray,
                   query_starts: np.ndarray) -> torch.Tensor | None:
        """The step's ``inputs_embeds``: token embeddings with each scheduled image
        placeholder's row replaced by its slice of the image's (cached) encoder output; None
        when the step computes no image token. A chunk may start or end inside an image."""
        rows_idx: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        for i, rid in enumerate(req_ids):
            features = self._features.get(rid)
            if not features:
                continue
            start, n = int(computed[i]), int(num_scheduled[i])
            qs = int(query_starts[i])
            for f in features:
                lo, hi = max(start, f.offset), min(start + n, f.offset + f.length)
                if lo >= hi:
                    continue
                parts.append(self.encoder_cache[f.identifier][lo - f.offset:hi - f.offset])
                rows_idx.append(torch.arange(qs + lo - start, qs + hi - start))
        if not parts:
            return None
        embeds = model.embed_input_ids(input_ids.to(self.device))
        embeds[torch.cat(rows_idx).to(self.device)] = torch.cat(parts).to(embeds.dtype)
        return embeds
