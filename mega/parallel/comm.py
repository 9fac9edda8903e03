"""Collectives mega uses, behind one set of names that work on torch 2.11 and 2.13, gloo and NCCL.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and warns
on the old names; 2.11 has only the old ones. Gloo has no PREMUL_SUM, so averages are taken by
scaling before a SUM there; NCCL scales inside its reduction (:func:`premul_sum`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
MAX = dist.ReduceOp.MAX


def group_size(group: Any) -> int:
    """The size of ``group``; 1 for None (a dimension of size 1 has no group)."""
    return 1 if group is None else dist.get_world_size(group)


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` (picklable) on every rank of the job; ``value`` itself without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce(tensor: torch.Tensor, group: Any, op: Any = None, async_op: bool = False) -> Any:
    """In-place SUM (or ``op``) over ``group``; a no-op when ``group`` is None."""
    if group is None:
        return None
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False
) -> Any:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (group size x input)."""
    if group is None:
        output.copy_(input)
        return None
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False, op: Any = None
) -> Any:
    """SUM (or ``op``) ``input`` over ``group`` and keep this rank's dim-0 slice of the result in
    ``output``."""
    if group is None:
        output.copy_(input)
        return None
    op = op or dist.ReduceOp.SUM
    return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)


# backends whose reductions take NCCL's PREMUL_SUM: NCCL, and torch's ``fake`` one, which plans a
# GPU run (mega.core.plan.shadow) and so counts what NCCL's runs do
_PREMUL_BACKENDS = ("nccl", "fake")


def premul_sum(factor: float, group: Any) -> Any | None:
    """A SUM that multiplies each rank's input by ``factor`` inside the reduction kernel (NCCL's
    PREMUL_SUM), for ``group``'s backend; None where it has none (gloo): the caller scales
    first. Why: a separate scaling pass reads and writes every gradient once more (on 2 H200,
    3.9 ms of a 193 ms DP2 step of issue 46's MoE, 2026-12-01)."""
    if group is None or dist.get_backend(group) not in _PREMUL_BACKENDS:
        return None
    return dist._make_nccl_premul_sum(factor)


class PostedBatch:
    """The handles of a batch posted without waiting. ``wait`` may be called any number of
    times: a second ``wait`` on a gloo receive handle itself blocks for a message that never
    comes (found as a hang of the interleaved schedule)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


def exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: Any,
    wait: bool = True,
) -> PostedBatch | None:
    """Post every send and receive (``(tensor, global peer rank)``) as one batch; wait for all of
    it, or with ``wait=False`` return it to wait for later.

    One batch is one NCCL group: its sends and receives progress together, so two ranks that send
    to each other in the same batch do not wait on one another. Messages between a pair of ranks
    are matched in the order they were posted.
    """
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in recvs]
    posted = PostedBatch(dist.batch_isend_irecv(ops) if ops else [])
    if not wait:
        return posted
    posted.wait()
    return None
