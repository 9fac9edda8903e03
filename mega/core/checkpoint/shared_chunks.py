"""Chunks that several pieces would write: gathered at one rank and written once, whole.

A backend stores an array as chunk files, each written whole. A piece that covers part of a
chunk makes tensorstore read the chunk, merge and write it back, and when two ranks write parts
of one chunk their conditional writes collide: the loser reads the chunk again and writes all
of it again. Distributed-optimizer ranges end anywhere inside a tensor (the middle of each
gradient bucket), so at DP2 the Adam moments and masters of the tensor holding each bucket's
middle (a 1.3B GPT: ``linear_fc1`` of every layer, one 64 MB chunk each) were written that way,
by both ranks, and as a partial row plus whole rows by each: the DP2 save of the same bytes took
twice as long as the TP2 one.

So, before a save (a collective), the ranks exchange the boxes they write; each chunk touched by
more than one piece (of any ranks) gets an owner, the rank holding most of it, the other ranks
send it their parts (point to point), and the owner writes the chunk as one box, a copy it owns
(``Piece.owned``); every rank writes its pieces less those chunks. Every chunk is then written
by one rank in one box. The chunk grid is the backend's: the tensor's ``chunks`` (its whole shape
when none) with the first dimension cut to a divisor of itself so that a chunk holds at most
``CHUNK_BYTES``, the rule the zarr backend creates its arrays with (it calls :func:`chunk_grid`);
the arrays concerned are created with that grid named explicitly, so that no backend cuts it
differently. The stored arrays are as before.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from math import prod
from typing import Any

import torch

from mega.parallel.sharded import Piece, ShardedTensor

CHUNK_BYTES = 64 << 20  # a chunk file is at most this large (fewer, larger files write faster)
BATCH_BYTES = 256 << 20  # chunks gathered at once: bounds the device memory it takes

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)


def chunk_grid(shape: tuple[int, ...], chunks: tuple[int, ...] | None, itemsize: int) -> tuple:
    """The chunk shape a backend stores ``shape`` with: ``chunks`` (or the whole shape), its
    first dimension cut to a divisor of itself so that a chunk holds at most ``CHUNK_BYTES``."""
    chunk = [max(1, c) for c in (chunks or shape)]
    if not chunk:
        return ()
    row = itemsize * prod(chunk[1:])
    rows = chunk[0]
    while rows > 1 and rows * row > CHUNK_BYTES:
        rows = next(d for d in range(rows // 2, 0, -1) if chunk[0] % d == 0)
    chunk[0] = rows
    return tuple(chunk)


def cells(box: Box, grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The chunk indices that ``box`` touches."""
    start, shape = box
    if any(n == 0 for n in shape):
        return []
    ranges = [
        range(s // c, (s + n - 1) // c + 1) for s, n, c in zip(start, shape, grid, strict=True)
    ]
    return list(itertools.product(*ranges))


def cell_box(cell: tuple[int, ...], grid: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """The box of chunk ``cell`` inside an array of ``shape`` (edge chunks are cut)."""
    start = tuple(i * c for i, c in zip(cell, grid, strict=True))
    return start, tuple(min(c, g - s) for s, c, g in zip(start, grid, shape, strict=True))


def intersect(a: Box, b: Box) -> Box:
    start = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    return start, tuple(max(0, e - s) for s, e in zip(start, end, strict=True))


def _view(data: torch.Tensor, origin: tuple[int, ...], box: Box) -> torch.Tensor:
    """The part ``box`` (global coordinates) of ``data``, whose element 0 sits at ``origin``."""
    for dim, (s, n, o) in enumerate(zip(box[0], box[1], origin, strict=True)):
        data = data.narrow(dim, s - o, n)
    return data


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def describe(tensors: list[ShardedTensor]) -> dict[str, Any]:
    """What a rank tells the others of the pieces it writes:
    ``{key: (shape, itemsize, grid, boxes)}``."""
    return {
        t.key: (
            tuple(t.global_shape),
            _itemsize(t.dtype),
            chunk_grid(t.global_shape, t.chunks, _itemsize(t.dtype)),
            [(tuple(p.start), tuple(p.data.shape)) for p in t.pieces],
        )
        for t in tensors
    }


def plan(described: list[dict[str, Any]]) -> dict[str, tuple[tuple, dict]]:
    """From every rank's :func:`describe`: ``{key: (grid, itemsize, {cell: (owner, box,
    parts)})}`` for the arrays with chunks that more than one piece touches, each such chunk
    with its owner, its box and the ``(rank, piece index, part)`` of every piece in it; the same
    on every rank."""
    shared_arrays = {}
    for key in sorted({key for theirs in described for key in theirs}):
        shape, itemsize, grid, _ = next(theirs[key] for theirs in described if key in theirs)
        touched: dict[tuple[int, ...], list] = {}
        for rank, theirs in enumerate(described):
            for index, box in enumerate(theirs[key][3] if key in theirs else []):
                for cell in cells(box, grid):
                    touched.setdefault(cell, []).append((rank, index, box))
        shared = {}
        for cell in sorted(c for c, who in touched.items() if len(who) > 1):
            whole = cell_box(cell, grid, shape)
            parts = [(rank, index, intersect(box, whole)) for rank, index, box in touched[cell]]
            held: dict[int, int] = {}
            for rank, _, part in parts:
                held[rank] = held.get(rank, 0) + prod(part[1])
            owner = max(sorted(held), key=lambda r: held[r])  # the most; ties: the lowest rank
            shared[cell] = (owner, whole, parts)
        if shared:
            shared_arrays[key] = (grid, itemsize, shared)
    return shared_arrays


def _to_host(data: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host copy of a gathered chunk. ``pinned`` (an async save, whose step waits for this):
    on CUDA into page-locked memory, still in flight on the current stream; pageable copies
    made the stall of a 1.3B GPT's DP2 async save 3.8-5.0 s on 2 H100 instead of 0.5-0.6.
    The memory comes from torch's caching host allocator, which keeps it for the next save;
    :func:`warm_pinned_copies` fills that cache before the first."""
    if not (pinned and data.is_cuda):
        return data.cpu()
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    return host.copy_(data, non_blocking=True)


def owned_chunk_bytes(tensors: list[ShardedTensor], rank: int, gather: Any) -> list[int]:
    """The size in bytes of each chunk that :func:`consolidate` of ``tensors`` would gather at
    ``rank``. A collective, as ``consolidate`` is (``gather`` as there)."""
    return [
        prod(whole[1]) * itemsize
        for _, itemsize, shared in plan(gather(describe(tensors))).values()
        for owner, whole, _ in shared.values()
        if owner == rank
    ]


def warm_pinned_copies(sizes: list[int]) -> None:
    """Allocate page-locked blocks of ``sizes`` bytes, all at once, and free them: torch's host
    allocator keeps them, and the first async save's :func:`_to_host` copies reuse them instead
    of pinning GBs while the step waits (2 H200, DP2 1.3B GPT: the first save stalled 3.58 s,
    the second, reusing them, 0.49 s)."""
    blocks = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    del blocks


def consolidate(
    tensors: list[ShardedTensor], rank: int, gather: Any, exchange: Any, *, pinned: bool = False
) -> list[ShardedTensor]:
    """``tensors`` (this rank's, to be written) with every chunk that several pieces touch
    written whole by its owner (see the module docstring). A collective: ``gather(value)`` is
    every rank's value, and ``exchange(ops)`` runs point-to-point ops ``(send, peer, tensor)``
    (every rank calls it at the same points, with the ops it takes part in). ``pinned``: the
    owned chunks' host copies go to page-locked memory, each batch's in flight while the next
    is exchanged; they are complete when this returns."""
    shared_arrays = plan(gather(describe(tensors)))
    if not shared_arrays:
        return tensors
    by_key = {t.key: t for t in tensors}
    owned: dict[tuple[str, tuple[int, ...]], Piece] = {}
    ops: list[tuple[bool, int, torch.Tensor]] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received bytes, where they go)
    filling: list[tuple[str, tuple[int, ...]]] = []  # this batch's chunks
    in_flight = 0

    def flush() -> None:
        nonlocal in_flight
        exchange(ops)
        for received, target in landing:
            target.copy_(received.view(target.dtype).view(target.shape))
        for name in filling:  # complete: to the host (the backend writes from there anyway)
            piece = owned[name]
            owned[name] = Piece(piece.start, _to_host(piece.data, pinned), owned=True)
        ops.clear()
        landing.clear()
        filling.clear()
        in_flight = 0

    for key, (_, itemsize, shared) in shared_arrays.items():
        mine = by_key.get(key)
        for cell, (owner, whole, parts) in shared.items():
            # chunks gathered at once (their buffers and the parts in flight), counted alike on
            # every rank, so that all flush at the same chunks
            in_flight += prod(whole[1]) * itemsize
            if owner == rank:
                device = next(mine.pieces[i].data.device for r, i, _ in parts if r == rank)
                buffer = torch.zeros(whole[1], dtype=mine.dtype, device=device)
                owned[(key, cell)] = Piece(whole[0], buffer, owned=True)
                filling.append((key, cell))
            for who, index, part in parts:
                if who == owner == rank:
                    piece = mine.pieces[index]
                    _view(buffer, whole[0], part).copy_(_view(piece.data, piece.start, part))
                elif who == rank:
                    piece = mine.pieces[index]
                    values = _view(piece.data, piece.start, part).contiguous()
                    ops.append((True, owner, values.view(-1).view(torch.uint8)))
                elif owner == rank:
                    target = _view(buffer, whole[0], part)
                    nbytes = prod(part[1]) * target.element_size()
                    received = torch.empty(nbytes, dtype=torch.uint8, device=buffer.device)
                    ops.append((False, who, received))
                    landing.append((received, target))
            if in_flight >= BATCH_BYTES:
                flush()
    flush()
    if pinned and torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # the pinned copies, once for all batches
    out = []
    for t in tensors:
        if t.key not in shared_arrays:
            out.append(t)
            continue
        grid, _, shared = shared_arrays[t.key]
        pieces = []
        for piece in t.pieces:
            box = (tuple(piece.start), tuple(piece.data.shape))
            touched = cells(box, grid)
            if not any(c in shared for c in touched):
                pieces.append(piece)
                continue
            for cell in touched:  # the piece less the shared chunks, one box per chunk
                if cell not in shared:
                    part = intersect(box, cell_box(cell, grid, t.global_shape))
                    pieces.append(Piece(part[0], _view(piece.data, piece.start, part)))
        pieces += [owned[(t.key, cell)] for cell in shared if (t.key, cell) in owned]
        out.append(replace(t, pieces=pieces, chunks=grid))
    return out
