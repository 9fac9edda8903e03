"""The copy-engine split (``MEGA_TP_SPLIT_OVERLAP=copy-engine``,
:mod:`mega.parallel.tensor.copy_engine_split`, and without sequence parallelism its all-reduces,
:mod:`mega.parallel.tensor.copy_engine_reduce`, which use the split's transport) as the planner
counts it.

On the meta device no inbox, stream or signal exists, and the split's bodies would take the NCCL
split (its collectives counted whole, as if nothing ran beside them). While planning, the split
runs its copy-engine bodies with the transport replaced: each pass records the bytes it sends,
its copies (one per peer, each with the copy's fixed cost) and the FLOPs of the GEMMs that run
beside them (``Work.beside``); the time model shows only the transfer's part longer than those
GEMMs. The blocks that arrive are meta tensors of the block's shape. Not counted: the inboxes'
memory (five per group with SP, a slot per rank: ~160 MiB a GPU for the 1.3B GPT at TP2,
micro-batch 4; without SP two per chunk pair, ~128 MiB) and the signal kernels' launches. The plan takes the copy engine as asked: a run whose tensor-
parallel ranks span hosts (or a CPU run) takes the NCCL split instead, which this does not see.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mega.core.plan.tracking import StepTracker, Work, nbytes
from mega.parallel.tensor import copy_engine_split, split_overlap


class _PlannedInbox:
    """A group's inbox while planning: its ranks, what the pass sent and when."""

    def __init__(self, group: Any) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.handle = SimpleNamespace(rank=rank, world_size=size)
        self.peers = [(rank + k) % size for k in range(1, size)]
        self.sent, self.copies, self.flops_at_send = 0, 0, 0.0


def _work() -> Work:
    """The planner's current count; a throwaway one where no step is being counted (a unit
    traced on meta to measure its compiled memory)."""
    mode = _get_current_dispatch_mode()
    return mode.work if isinstance(mode, StepTracker) else Work()


def inbox_for(group: Any, direction: str, like: torch.Tensor) -> _PlannedInbox:
    return _PlannedInbox(group)


def send_blocks(inbox: _PlannedInbox, blocks: dict[int, torch.Tensor], copy: Any = None) -> None:
    # ``copy`` (the MoE's peer-rows writes) never reaches the planner: on meta no peer copies
    inbox.sent, inbox.copies = sum(nbytes(block) for block in blocks.values()), len(blocks)
    inbox.flops_at_send = _work().matmul_flops


def receive(inbox: _PlannedInbox, like: torch.Tensor, use: Any) -> None:
    work = _work()
    work.beside[inbox.sent, inbox.copies, work.matmul_flops - inbox.flops_at_send] += 1
    for q in reversed(inbox.peers):
        use(q, torch.empty_like(like))


def by_copy_engine(group: Any, like: torch.Tensor) -> bool:
    return os.environ.get(split_overlap.SPLIT_ENV) == split_overlap.COPY_ENGINE


@contextlib.contextmanager
def planned_copy_engine() -> Iterator[None]:
    """Inside, the copy-engine split counts as the module docstring says."""
    saved = [(module, name, getattr(module, name)) for module, name in _PATCHED]
    for module, name in _PATCHED:
        setattr(module, name, _STAND_INS[name])
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


_STAND_INS = {
    "inbox_for": inbox_for,
    "send_blocks": send_blocks,
    "receive": receive,
    "by_copy_engine": by_copy_engine,
}
_PATCHED = [
    (copy_engine_split, "inbox_for"),
    (copy_engine_split, "send_blocks"),
    (copy_engine_split, "receive"),
    (split_overlap, "by_copy_engine"),
]
