"""What a sharded checkpoint backend writes and reads: global tensors, each rank its pieces.

A ``ShardedTensor`` is one global tensor (a model parameter, an Adam moment of it, its fp32
master) as one rank sees it: the tensor's key and global shape, and the boxes of it this rank
holds, each with a view of the rank's own memory. Saving writes the boxes' values into the
global array; loading reads each box from the stored array into the view, in place. The same
list, built at another layout, names other boxes of the same global tensors: that is resharding.

Where several ranks hold the same values (data-parallel replicas, tensor-parallel replicated
norms), one of them has ``write=True``; the others only read them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    import torch


@dataclass
class Piece:
    """A box of the global tensor: where it starts, and its values (shape = the box's shape),
    a view of the holder's tensor. ``owned``: the values are a copy made for one save, which
    nothing else changes (a chunk gathered from several ranks, ``shared_chunks``): an async
    save writes from it without copying it again."""

    start: tuple[int, ...]
    data: torch.Tensor
    owned: bool = False


@dataclass
class ShardedTensor:
    """One global tensor as this rank holds it (see the module docstring).

    ``key``: the stored name, ``/``-separated (``model/decoder.layers.0.mlp.linear_fc1.weight``).
    ``dtype``: the stored dtype (the pieces' dtype when they are written; a load casts).
    ``chunks``: a chunk shape that cuts the array where the writing layout's shards meet (a
    backend may use it); distributed-optimizer ranges end anywhere, and a save gathers each chunk
    they share at one rank (``mega.core.checkpoint.shared_chunks``), so no two ranks write one.
    ``fallback``: a load reads this key when ``key`` is not in the checkpoint (an fp32 master
    from the parameter of a checkpoint written in fp32), and ``optional`` loads leave the pieces
    as they are when neither exists.
    """

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    write: bool = True
    chunks: tuple[int, ...] | None = None
    fallback: str | None = None
    optional: bool = False


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as zarr and the metadata name it: ``float32``, ``bfloat16``, ..."""
    return str(dtype).removeprefix("torch.")
