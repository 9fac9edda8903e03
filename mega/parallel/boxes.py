"""Where a rank's piece of a tensor sits in the global tensor, as boxes. No torch at import time.

A sharded checkpoint stores every tensor whole (its *global* shape) and each rank writes or reads
the boxes it holds. A rank holds a tensor in one of two ways:

- a tensor-parallel shard (``ShardSpec``) of the global tensor, all of it;
- with the distributed optimizer, a flat range ``[lo, hi)`` of that shard, flattened row-major.

A flat range is cut into boxes that are each contiguous in flat order (a partial first row, whole
rows, a partial last row, recursively), so each box's values are a plain view of the flat
state. A box of the local shard is then cut where the shard's stacked blocks meet and moved to
its place in the global tensor. Vocabulary-sized tensors are stored without the padding rows
that only some layouts add: ``rows`` keeps the global rows below it.

    local shard [4, 3] of a column-parallel weight [8, 3] (index 1 of 2), flat range [2, 10):
        flat_boxes((4, 3), 2, 10) -> Box((0, 2), (1, 1), flat=2), Box((1, 0), (2, 3), flat=3),
                                     Box((3, 0), (1, 1), flat=9)
        place(...) of each: global starts (4, 2), (5, 0), (7, 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from mega.parallel.shard import ShardSpec

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from torch import Tensor


@dataclass(frozen=True)
class Box:
    """A box of a tensor: ``start`` and ``shape`` per dimension, and where its values begin in
    the holder's flat state (``flat``)."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    flat: int = 0


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape``, as boxes that are each
    contiguous in flat order (``Box.flat`` is where each begins)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [Box((lo,) if shape else (), (hi - lo,) if shape else (), lo)]
    inner = prod(shape[1:])
    boxes: list[Box] = []

    def rows_of(row: int, a: int, b: int) -> None:  # [a, b) inside one row
        for sub in flat_boxes(shape[1:], a, b):
            boxes.append(Box((row, *sub.start), (1, *sub.shape), row * inner + sub.flat))

    if lo % inner:
        row = lo // inner
        end = min(hi, (row + 1) * inner)
        rows_of(row, lo - row * inner, end - row * inner)
        lo = end
    whole = (hi - lo) // inner
    if whole:
        boxes.append(Box((lo // inner, *[0] * (len(shape) - 1)), (whole, *shape[1:]), lo))
        lo += whole * inner
    if lo < hi:
        row = lo // inner
        rows_of(row, 0, hi - row * inner)
    return boxes


def place(
    data: Tensor, start: tuple[int, ...], spec: ShardSpec | None, rows: int | None = None
) -> list[tuple[tuple[int, ...], Tensor]]:
    """``(global start, values)`` pairs for ``data``, the values of a box of the local shard that
    starts at ``start``: cut where the shard's stacked blocks meet (each piece goes elsewhere in
    the global tensor), without global rows at or past ``rows``. The values are views of
    ``data``, so reading into them fills the holder's tensor."""
    pairs = [(tuple(start), data)]
    if spec is not None:
        dim, piece = spec.split_dim, spec.piece
        block = spec.global_shape[dim] // spec.parts
        first, length = start[dim], data.shape[dim]
        pairs = []
        for p in range(first // piece, (first + length - 1) // piece + 1):
            a, b = max(first, p * piece), min(first + length, (p + 1) * piece)
            global_start = list(start)
            global_start[dim] = p * block + spec.index * piece + (a - p * piece)
            pairs.append((tuple(global_start), data.narrow(dim, a - first, b - a)))
    if rows is None or not start:
        return pairs
    clipped = []
    for global_start, values in pairs:
        kept = min(values.shape[0], rows - global_start[0])
        if kept > 0:
            clipped.append((global_start, values.narrow(0, 0, kept)))
    return clipped


def global_shape(spec: ShardSpec | None, local_shape: tuple[int, ...], rows: int | None) -> tuple:
    """The stored shape of a tensor held as ``local_shape`` under ``spec``, padding rows cut."""
    shape = list(spec.global_shape if spec is not None else local_shape)
    if rows is not None and shape:
        shape[0] = min(shape[0], rows)
    return tuple(shape)
