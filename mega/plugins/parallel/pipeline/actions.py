"""The actions a pipeline schedule is made of, and the layout of virtual stages.

A schedule *table* is ``dict[rank, list[Action]]`` for ``pp`` pipeline ranks. Each rank holds
``vpp`` model chunks; chunk ``c`` on rank ``r`` is virtual stage ``c * pp + r`` (Megatron's
interleaved layout), so the model runs through ranks 0..pp-1 with chunk 0, then again with chunk
1, and so on. With ``vpp == 1`` virtual stages are ranks. ``m`` micro-batches go through every
stage. A rank executes its list strictly in order, one action at a time:

- ``Forward(mb, c)`` runs chunk ``c`` on micro-batch ``mb``. Its input is the batch itself on the
  first virtual stage (0), otherwise the activation taken by an earlier
  ``RecvActivation(mb, c, peer)`` of this rank. On the last virtual stage it also computes the loss.
- ``Backward(mb, c)`` back-propagates chunk ``c`` for ``mb``; its ``Forward`` must come earlier in
  the list. Its output gradient comes from an earlier ``RecvGrad(mb, c, peer)``, except on the
  last virtual stage, whose forward computed the loss (nothing is received there).
- ``SendActivation(mb, c, peer)`` comes after ``Forward(mb, c)`` on every stage but the last and
  hands chunk ``c``'s output to ``peer``, the rank of the next virtual stage, where it is matched by
  exactly one ``RecvActivation(mb, c', this rank)`` (``c'`` is the receiver's chunk).
  ``SendGrad(mb, c, peer)`` comes after ``Backward(mb, c)`` on every stage but the first and hands
  the input gradient to the previous virtual stage's rank, matched by one ``RecvGrad``.
- Sends are asynchronous (an executor issues them as ``isend`` and keeps the buffer alive until the
  request completes); a receive blocks until the matching send has been issued. The built-in tables
  put each receive just before the compute that needs it and each send just after the compute that
  produced it; other placements are valid as long as these orders hold.

``chunk`` in a send or receive is always the *local* chunk of the rank whose list holds the action.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    """Forward of local chunk ``chunk`` on micro-batch ``microbatch``."""

    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    """Backward of local chunk ``chunk`` on micro-batch ``microbatch`` (after its forward)."""

    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class SendActivation:
    """Send the output of ``Forward(microbatch, chunk)`` to ``peer`` (the next virtual stage)."""

    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive the input of ``Forward(microbatch, chunk)`` from ``peer`` (the previous stage)."""

    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class SendGrad:
    """Send the input gradient of ``Backward(microbatch, chunk)`` to ``peer`` (previous stage)."""

    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the output gradient ``Backward(microbatch, chunk)`` needs from ``peer`` (next stage)."""

    microbatch: int
    chunk: int
    peer: int


Compute = Forward | Backward
Send = SendActivation | SendGrad
Recv = RecvActivation | RecvGrad
Action = Forward | Backward | SendActivation | RecvActivation | SendGrad | RecvGrad
Table = dict[int, list[Action]]


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    """The global virtual stage of local chunk ``chunk`` on pipeline rank ``rank``."""
    return chunk * pp + rank


def stage_place(stage: int, pp: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual stage ``stage``."""
    return stage % pp, stage // pp


def label(action: Compute, vpp: int = 1) -> str:
    """``F3`` / ``B3``, or ``F3.1`` (micro-batch 3, chunk 1) when there are several chunks."""
    kind = "F" if isinstance(action, Forward) else "B"
    return f"{kind}{action.microbatch}" + (f".{action.chunk}" if vpp > 1 else "")


def with_p2p(orders: dict[int, list[Compute]], pp: int, vpp: int) -> Table:
    """A table from per-rank compute orders: each receive is placed just before the compute that
    needs it and each send just after the compute that produced it."""
    last = pp * vpp - 1
    table: Table = {}
    for rank, order in orders.items():
        actions: list[Action] = []
        for op in order:
            stage = virtual_stage(rank, op.chunk, pp)
            mb = op.microbatch
            if isinstance(op, Forward):
                if stage > 0:
                    actions.append(RecvActivation(mb, op.chunk, stage_place(stage - 1, pp)[0]))
                actions.append(op)
                if stage < last:
                    actions.append(SendActivation(mb, op.chunk, stage_place(stage + 1, pp)[0]))
            else:
                if stage < last:
                    actions.append(RecvGrad(mb, op.chunk, stage_place(stage + 1, pp)[0]))
                actions.append(op)
                if stage > 0:
                    actions.append(SendGrad(mb, op.chunk, stage_place(stage - 1, pp)[0]))
        table[rank] = actions
    return table
