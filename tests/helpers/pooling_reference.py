"""transformers' final hidden states pooled as a pooling engine pools them: the reference of
the embedding tests."""
from __future__ import annotations

from pathlib import Path

import torch


def reference_embeddings(model_dir: Path, prompts: list[list[int]], kind: str,
                         normalize: bool) -> list[torch.Tensor]:
    """Per prompt (token ids): the base model's ``last_hidden_state`` (after its final norm),
    pooled by ``kind`` (LAST, MEAN, CLS), L2-normalized if ``normalize``; float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
        out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out
