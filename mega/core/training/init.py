"""Layout-invariant parameter initialisation: a parameter's values depend on the seed and its name.

Each parameter draws from its own CPU generator seeded by ``sha256(f"{seed}/{name}")``, so the
global tensor is the same whatever device, process count or construction order produced it. A
parallel layout rebuilds the global tensor (or the slice it needs) and keeps its shard.
"""

from __future__ import annotations

import hashlib

import torch


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's global name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_(param: torch.Tensor, *, std: float, seed: int, name: str) -> torch.Tensor:
    """Fill ``param`` in place with N(0, std²) values drawn on the CPU from its own generator."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(param_seed(seed, name))
    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    with torch.no_grad():
        param.copy_(values)
    return param
