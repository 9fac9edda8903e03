"""What a compiled MoE layer runs eagerly where a shape depends on the routing: the host-side
split of rows by expert and ``nonzero`` break the graph there anyway, so they run here, behind
``torch.compiler.disable``, and hand the graph after them tensors whose data-dependent length
is marked *unbacked*. Dynamo then compiles that graph once for every length, where after a plain
graph break it compiled it for the first call's lengths, again (dynamic) at the second, and
again when a length happened to repeat another (seen on CPU with ``TORCH_LOGS=recompiles``: a
one-device dropless run recompiled once, an expert-parallel allgather run six or seven frames
on each rank).

Imports ``torch._dynamo``: import this module only where torch.compile traces (an eager process
does not load dynamo, ``mega.parallel.weight_grad.traced``).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.decorators import mark_unbacked

from mega.parallel.expert.sort_keys import narrow_ids


@torch.compiler.disable
def split_rows(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x.split(counts.tolist())``, each piece's row count unbacked (any count, 0 included)."""
    pieces = x.split(counts.tolist())
    for piece in pieces:
        mark_unbacked(piece, 0)
    return pieces


@torch.compiler.disable
def grouped_rows(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x[:counts.sum()]``, the rows the groups hold, their count unbacked: flex's arrival
    buffer for the expert loop, which reads the counts on the host anyway."""
    rows = x[: int(counts.sum())]
    mark_unbacked(rows, 0)
    return rows


def unbacked_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``, its row count marked unbacked for the graph that takes it (called eagerly, as
    the rest of this module): the expert all-to-all's arrived rows."""
    mark_unbacked(x, 0)
    return x


@torch.compiler.disable
def held_slots(
    flat: torch.Tensor, k: int, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mega.parallel.expert.local.assign`'s three tensors for the slots of ``flat``
    (``[T * k]`` expert ids, -1 dropped) whose expert is one of ``first .. first + count - 1``:
    those slots grouped by expert (stable) and their tokens, both of an unbacked length, and the
    rows per expert ``[count]``."""
    local = flat - first
    slots = ((flat >= 0) & (local >= 0) & (local < count)).nonzero().squeeze(1)
    local = local[slots]
    order = torch.argsort(narrow_ids(local, count), stable=True)
    slots = slots[order]
    tokens = slots // k
    mark_unbacked(slots, 0)
    mark_unbacked(tokens, 0)
    return slots, tokens, torch.bincount(local, minlength=count)
