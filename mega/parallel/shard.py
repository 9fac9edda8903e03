"""How a parameter shard maps onto its global tensor. No torch at import time.

A tensor-parallel parameter is one of ``count`` equal pieces of a global tensor, cut along
``split_dim``. A plain split keeps one contiguous range. A *stacked* weight (SwiGLU's fc1 is
``[gate; up]`` along its output dim, ``parts = 2``) is cut block by block, so each shard keeps a
piece of every block, which is what lets the local ``chunk(2)`` still find a gate and an up half:

    global rows  [ gate 0..f | up f..2f ],  count 2, index 1  ->  rows [f/2, f) and [3f/2, 2f)

Checkpoints store global tensors; ``ranges()`` says where a shard's values go in them, and
``local_shard``/``full_tensor`` cut and reassemble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    import torch


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` of ``count`` of a tensor of ``global_shape``, cut along ``split_dim``.

    ``parts`` is the number of blocks stacked along ``split_dim`` (1 for a plain split); each
    block is split separately. ``group`` names the topology dimension the shards are spread over.
    """

    global_shape: tuple[int, ...]
    split_dim: int
    parts: int
    index: int
    count: int
    group: str = "tp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        if not 0 <= self.split_dim < len(self.global_shape):
            raise ValueError(f"split_dim {self.split_dim} is outside shape {self.global_shape}")
        if self.parts < 1 or self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(
                f"bad shard: parts {self.parts}, index {self.index}, count {self.count}"
            )
        size = self.global_shape[self.split_dim]
        if size % (self.parts * self.count):
            raise ValueError(
                f"dim {self.split_dim} of {self.global_shape} ({size}) does not split into "
                f"{self.parts} block(s) x {self.count} shards"
            )

    @property
    def piece(self) -> int:
        """Length along ``split_dim`` of this shard's piece of one block."""
        return self.global_shape[self.split_dim] // (self.parts * self.count)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.split_dim] = self.piece * self.parts
        return tuple(shape)

    def ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges along ``split_dim`` of the global tensor that this shard
        holds, in local order (one per stacked block)."""
        block = self.global_shape[self.split_dim] // self.parts
        start = self.index * self.piece
        return [(p * block + start, p * block + start + self.piece) for p in range(self.parts)]

    def with_index(self, index: int) -> ShardSpec:
        """The spec of another shard of the same tensor."""
        return ShardSpec(
            self.global_shape, self.split_dim, self.parts, index, self.count, self.group
        )


def local_shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This shard's values cut out of the global tensor (a new contiguous tensor)."""
    import torch

    if tuple(full.shape) != spec.global_shape:
        raise ValueError(f"tensor shape {tuple(full.shape)} != global shape {spec.global_shape}")
    pieces = [full.narrow(spec.split_dim, start, stop - start) for start, stop in spec.ranges()]
    return torch.cat(pieces, dim=spec.split_dim).contiguous()


def full_tensor(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Reassemble the global tensor from every shard, ordered by shard index."""
    import torch

    if len(shards) != spec.count:
        raise ValueError(f"expected {spec.count} shards, got {len(shards)}")
    for shard in shards:
        if tuple(shard.shape) != spec.local_shape:
            raise ValueError(f"shard shape {tuple(shard.shape)} != {spec.local_shape}")
    # Each shard is [piece of block 0, piece of block 1, ...]; the global tensor is every shard's
    # piece of block 0, then every shard's piece of block 1, and so on.
    split = [shard.split(spec.piece, dim=spec.split_dim) for shard in shards]
    blocks = [piece for p in range(spec.parts) for piece in (s[p] for s in split)]
    return torch.cat(blocks, dim=spec.split_dim)
