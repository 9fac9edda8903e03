"""On the meta device (``mega plan``): the share of a grouped GEMM's rows that its groups fill.

On a GPU the experts' grouped GEMM (``torch._grouped_mm``) is handed every row a dispatcher has
room for and computes only the rows of its groups, the rows below its last offset; its outputs,
and what backward keeps of them, have room for all. ``held_mixture`` (the ``allgather``
dispatcher) hands it all ``n * T * k`` gathered slots, of which a balanced routing fills
``T * k`` at ``n`` expert-parallel ranks; flex's padded arrival has room for every routing. A
plan that ran the experts on the filled rows alone kept ``n`` times too little of them: an EP4
rank of issue 46's MoE was planned at 24.9 GiB against 33.0 measured (one H200 over the fake
group, 2026-12-02).

So on meta the experts run on every row, as the GPU does, and the groups' sizes (meta: no
values) carry the share of the rows they fill: :func:`grouped_offsets` passes it from the
counts to the GEMM's offsets, where the planner's tracker reads it (:func:`share_of`) to count
the GEMMs' FLOPs, forward and backward, for the filled rows alone. Off meta nothing is marked
and every share is 1. Nor is anything marked while a graph is traced (the planner's measurement
of a compiled unit's memory, which counts no FLOPs): a dictionary write there would break it.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# a meta tensor's storage -> the share of its grouped GEMM's rows that the groups fill
_SHARES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_filled(counts: torch.Tensor, share: float) -> torch.Tensor:
    """``counts`` (the groups' sizes, on meta), marked as filling ``share`` of the rows."""
    if counts.is_meta and not torch.compiler.is_compiling():
        _SHARES[counts.untyped_storage()] = share
    return counts


def share_of(t: torch.Tensor | None) -> float:
    """The share of the rows filled by the groups whose sizes or offsets ``t`` holds (1 unless
    marked)."""
    if t is None or not t.is_meta or torch.compiler.is_compiling():
        return 1.0
    return _SHARES.get(t.untyped_storage(), 1.0)


def grouped_offsets(counts: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM's ``offs`` (int32 cumulative ends) of the groups' sizes ``counts``, with
    their mark (module docstring)."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    share = share_of(counts)
    return mark_filled(offsets, share) if share != 1.0 else offsets
