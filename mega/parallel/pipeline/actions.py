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
- ``WeightGrad(mb, c)`` (optional, at most one, after ``Backward(mb, c)``) computes the weight
  gradients of that backward, which then computes only what the previous stage waits for (the
  input gradient): split off, they can run where the rank would otherwise wait (zero-bubble
  schedules, Qi et al. 2023). Weight gradients directly after a batch of transfers run while the
  batch is in flight: they need nothing from it.
- ``SendActivation(mb, c, peer)`` comes after ``Forward(mb, c)`` on every stage but the last and
  hands chunk ``c``'s output to ``peer``, the rank of the next virtual stage, where it is matched by
  exactly one ``RecvActivation(mb, c', this rank)`` (``c'`` is the receiver's chunk).
  ``SendGrad(mb, c, peer)`` comes after ``Backward(mb, c)`` on every stage but the first and hands
  the input gradient to the previous virtual stage's rank, matched by one ``RecvGrad``.
- The executor issues each maximal run of consecutive sends and receives in a rank's list as one
  ``batch_isend_irecv`` (``p2p_batches`` groups them) and waits for it before going on. With
  NCCL a large send cannot finish before its receive is running, and the messages from rank a to
  rank b are matched in order (tags are ignored): the k-th send from a to b is received by the
  k-th receive on b from a, so both sequences must agree on what they carry. ``simulate`` checks
  this and runs a table with eager sends or with these rendezvous ones. The built-in tables come
  from ``with_p2p``, which puts each receive before the compute that needs it and each send after
  the compute that produced it, grouped so that they run either way.

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
class WeightGrad:
    """The weight gradients of ``Backward(microbatch, chunk)``, computed later than its input
    gradient (the table's ``Backward`` of that pair then defers them)."""

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


Compute = Forward | Backward | WeightGrad
Send = SendActivation | SendGrad
Recv = RecvActivation | RecvGrad
Action = Forward | Backward | WeightGrad | SendActivation | RecvActivation | SendGrad | RecvGrad
Table = dict[int, list[Action]]
P2PBatch = tuple[Send | Recv, ...]


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    """The global virtual stage of local chunk ``chunk`` on pipeline rank ``rank``."""
    return chunk * pp + rank


def stage_place(stage: int, pp: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual stage ``stage``."""
    return stage % pp, stage // pp


def label(action: Compute, vpp: int = 1) -> str:
    """``F3`` / ``B3`` / ``W3``, or ``F3.1`` (micro-batch 3, chunk 1) when there are several
    chunks."""
    kind = {Forward: "F", Backward: "B", WeightGrad: "W"}[type(action)]
    return f"{kind}{action.microbatch}" + (f".{action.chunk}" if vpp > 1 else "")


def transfer_of(rank: int, op: Send | Recv, pp: int) -> tuple[str, int, int]:
    """What a send or receive in rank ``rank``'s list carries: (kind, micro-batch, the receiver's
    virtual stage). A send and a receive are the two ends of one message when these are equal."""
    stage = virtual_stage(rank, op.chunk, pp)
    if isinstance(op, SendActivation):
        return ("activation", op.microbatch, stage + 1)
    if isinstance(op, SendGrad):
        return ("grad", op.microbatch, stage - 1)
    return ("activation" if isinstance(op, RecvActivation) else "grad", op.microbatch, stage)


def p2p_batches(actions: list[Action]) -> list[Compute | P2PBatch]:
    """A rank's actions as the executor issues them: each maximal run of consecutive sends and
    receives becomes one tuple (one ``batch_isend_irecv`` call, list order kept); a compute
    stays a single item."""
    items: list[Compute | P2PBatch] = []
    run: list[Send | Recv] = []
    for action in actions:
        if isinstance(action, Forward | Backward | WeightGrad):
            if run:
                items.append(tuple(run))
                run = []
            items.append(action)
        else:
            run.append(action)
    if run:
        items.append(tuple(run))
    return items


def split_weight_grads(table: Table) -> Table:
    """``table`` with every backward's weight gradients split off: each ``Backward`` gets its
    ``WeightGrad`` just before the rank's next forward or backward, after the transfers that
    follow the backward. So the input gradient is sent as soon as it exists, and the weight
    gradients run while that batch of transfers is in flight, filling time the rank would
    otherwise spend waiting. The batches and their order are unchanged, so a table that runs
    with rendezvous transfers still does."""
    split: Table = {}
    for rank, actions in table.items():
        result: list[Action] = []
        pending: list[WeightGrad] = []
        for action in actions:
            if isinstance(action, Forward | Backward) and pending:
                result += pending
                pending = []
            result.append(action)
            if isinstance(action, Backward):
                pending.append(WeightGrad(action.microbatch, action.chunk))
        split[rank] = result + pending
    return split
