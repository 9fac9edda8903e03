"""The keys MoE routing sorts its slots by."""

from __future__ import annotations

import torch


def narrow_ids(ids: torch.Tensor, count: int) -> torch.Tensor:
    """Expert ids (below ``count``; -1 for a dropped slot) in the narrowest signed integer type
    that holds them, to sort by: a radix sort makes one pass per byte of its keys (CUDA sorts
    int64 ids in 8 passes, 8 kernels, where int8 ids take one), and a stable sort of the same
    values gives the same order."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if count <= torch.iinfo(dtype).max:
            return ids.to(dtype)
    return ids
