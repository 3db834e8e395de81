"""The index of each row's largest value: what every greedy pick and every exponential race in
the sampling path takes (``torch.argmax(x, dim=-1)``'s result, bit for bit).

On the CPU torch's argmax over a vocabulary row is a scalar loop (a parallel region for several
rows), where numpy's is vectorised and an order of magnitude faster: a batch-1 decode step pays
it every token. Both return the first index of the maximum, and both treat NaN as the maximum
(the first NaN's index), so numpy's answer is torch's (``tests/test_sampler.py`` pins it on
ties, infinities and NaNs). Other devices, dtypes numpy lacks (bf16) and tensors that need
autograd keep torch's own.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["argmax_rows"]

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64, on ``x``'s device) for ``x`` ``[..., V]``."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or x.requires_grad \
            or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(dim=-1)
    # np.asarray: a 1-D x gives a numpy scalar (torch: a 0-dim tensor)
    return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))
