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


def _transfers(rank: int, op: Compute, pp: int, last: int) -> tuple[Recv | None, Send | None]:
    """The receive ``op`` needs before it runs and the send of what it produced (None at an end
    of the pipeline)."""
    stage = virtual_stage(rank, op.chunk, pp)
    mb, chunk = op.microbatch, op.chunk
    if isinstance(op, Forward):
        recv = RecvActivation(mb, chunk, stage_place(stage - 1, pp)[0]) if stage > 0 else None
        send = SendActivation(mb, chunk, stage_place(stage + 1, pp)[0]) if stage < last else None
    else:
        recv = RecvGrad(mb, chunk, stage_place(stage + 1, pp)[0]) if stage < last else None
        send = SendGrad(mb, chunk, stage_place(stage - 1, pp)[0]) if stage > 0 else None
    return recv, send


def transfer_of(rank: int, op: Send | Recv, pp: int) -> tuple[str, int, int]:
    """What a send or receive in rank ``rank``'s list carries: (kind, micro-batch, the receiver's
    virtual stage). A send and a receive are the two ends of one message when these are equal."""
    stage = virtual_stage(rank, op.chunk, pp)
    if isinstance(op, SendActivation):
        return ("activation", op.microbatch, stage + 1)
    if isinstance(op, SendGrad):
        return ("grad", op.microbatch, stage - 1)
    return ("activation" if isinstance(op, RecvActivation) else "grad", op.microbatch, stage)


def _gap_times(
    gaps: dict[int, list[list[Send | Recv]]], steps: dict[int, list[list[Compute]]], pp: int
) -> dict[int, list[tuple[float, float]]] | None:
    """Run a table held as gaps and steps (gap ``i`` before step ``i``, one more after the last)
    with unit costs and eager sends, the default model of ``simulate``. For each rank, the time
    interval each gap is open: from the end of the step before it to the start of the step after
    it (the last one is open-ended). None if the table does not finish."""
    posted: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(gaps, 0.0)
    cursor = dict.fromkeys(gaps, 0)  # gaps done on each rank
    times: dict[int, list[tuple[float, float]]] = {rank: [] for rank in gaps}
    progress = True
    while progress:
        progress = False
        for rank, rank_gaps in gaps.items():
            while cursor[rank] < len(rank_gaps):
                gap = rank_gaps[cursor[rank]]
                opens = clock[rank]
                for op in gap:  # the sends are posted on entering the gap, the receives wait
                    if not isinstance(op, RecvActivation | RecvGrad):
                        posted.setdefault(transfer_of(rank, op, pp), opens)
                recvs = [op for op in gap if isinstance(op, RecvActivation | RecvGrad)]
                if any(transfer_of(rank, op, pp) not in posted for op in recvs):
                    break
                for op in recvs:
                    clock[rank] = max(clock[rank], posted[transfer_of(rank, op, pp)])
                if cursor[rank] < len(steps[rank]):
                    times[rank].append((opens, clock[rank]))
                    clock[rank] += len(steps[rank][cursor[rank]])
                else:
                    times[rank].append((opens, float("inf")))
                cursor[rank] += 1
                progress = True
    if any(cursor[rank] < len(rank_gaps) for rank, rank_gaps in gaps.items()):
        return None
    return times


_Placement = tuple[
    dict[int, list[list[Send | Recv]]],  # per rank: the gaps (gap i before step i, one more)
    dict[int, list[list[Compute]]],  # per rank: the steps
    dict[tuple[int, bool, int, int], int],  # (rank, is forward, micro-batch, chunk) -> its step
]


def _place(
    orders: dict[int, list[Compute]], pp: int, vpp: int, steps: dict[int, list[int]] | None
) -> _Placement:
    """Each receive in the gap before the step that needs it, each send in the gap after the
    step that produced it."""
    last = pp * vpp - 1
    groups: dict[int, list[list[Compute]]] = {}
    gaps: dict[int, list[list[Send | Recv]]] = {}
    step_of: dict[tuple[int, bool, int, int], int] = {}
    for rank, order in orders.items():
        sizes = (steps or {}).get(rank) or [1] * len(order)
        if sum(sizes) != len(order) or min(sizes, default=1) < 1:
            raise ValueError(f"rank {rank}: steps {sizes} do not cut its {len(order)} computes")
        groups[rank], start = [], 0
        for size in sizes:
            groups[rank].append(order[start : start + size])
            start += size
        gaps[rank] = [[] for _ in range(len(sizes) + 1)]
        for index, group in enumerate(groups[rank]):
            for op in group:
                step_of[rank, isinstance(op, Forward), op.microbatch, op.chunk] = index
                recv, send = _transfers(rank, op, pp, last)
                if recv is not None:
                    gaps[rank][index].append(recv)
                if send is not None:
                    gaps[rank][index + 1].append(send)
    return gaps, groups, step_of


def with_p2p(
    orders: dict[int, list[Compute]],
    pp: int,
    vpp: int,
    steps: dict[int, list[int]] | None = None,
) -> Table:
    """A table from per-rank compute orders, with the sends and receives between the computes.

    Each receive is placed just before the compute that needs it and each send just after the
    compute that produced it, so between two computes there is one run of transfers (one
    ``p2p_batches`` batch, one ``batch_isend_irecv``): the previous compute's sends, then the
    next one's receives. ``steps[rank]`` (optional) cuts a rank's order into steps of that many
    computes (summing to its length) that run back to back with no transfer between them, as
    Megatron's interleaved schedule does with ``send_forward_backward_recv_forward_backward``:
    the batch between two steps holds the sends of everything the first one produced and the
    receives of everything the second one needs.

    Transfers are rendezvous in a real run (NCCL: a large send only finishes while its receive
    runs, and a rank's batches run one at a time). The table above is kept if, with unit costs,
    it runs that way as fast as with eager sends and its sends and receives pair up in order
    (below). Otherwise every send whose receiver gets to the receive only after the sender has
    left the send's batch (timed with unit costs and eager sends) is moved to the sender's first
    later batch still open then; if, with steps, that still deadlocks or pairs wrongly, the same
    is done without steps. Without steps every send's batch then overlaps its receive's batch,
    so if the computes finish with eager sends they finish with rendezvous ones too, and with
    unit costs on the same timeline. (A send moved later can delay its receiver when forward and
    backward costs differ.)

    In a batch the sends come first, then the receives, each ordered by the batch of its partner
    op, then by what it carries, so that the k-th send from rank a to rank b meets the k-th
    receive on b from a: NCCL ignores tags and matches them in order (``simulate.fifo_problems``
    checks it)."""
    from mega.plugins.parallel.pipeline.simulate import rendezvous_delay  # (it imports us)

    gaps, groups, step_of = _place(orders, pp, vpp, steps)
    table = _assemble(gaps, groups, pp)
    if rendezvous_delay(table, pp) == 0:
        return table
    times = _gap_times(gaps, groups, pp)
    if times is None:
        return table  # the computes never finish, whatever the transfers: simulate says why
    _align_sends(gaps, times, step_of, pp)
    aligned = _assemble(gaps, groups, pp)
    if steps is None or rendezvous_delay(aligned, pp) is not None:
        return aligned
    gaps, groups, step_of = _place(orders, pp, vpp, None)
    times = _gap_times(gaps, groups, pp)
    if times is None:
        return aligned
    _align_sends(gaps, times, step_of, pp)
    return _assemble(gaps, groups, pp)


def _align_sends(
    gaps: dict[int, list[list[Send | Recv]]],
    times: dict[int, list[tuple[float, float]]],
    step_of: dict[tuple[int, bool, int, int], int],
    pp: int,
) -> None:
    """Move each send whose batch closes before its receive's batch opens (``times``) to the
    sender's first later batch still open then."""
    for rank, rank_gaps in gaps.items():
        for index in range(len(rank_gaps)):
            for op in list(rank_gaps[index]):
                if isinstance(op, RecvActivation | RecvGrad):
                    continue
                _, mb, stage = transfer_of(rank, op, pp)
                peer, chunk = stage_place(stage, pp)
                consumer = step_of.get((peer, isinstance(op, SendActivation), mb, chunk))
                if consumer is None:
                    continue  # nothing receives it: check_table reports that
                opens = times[peer][consumer][0]
                later = index
                while later < len(rank_gaps) - 1 and times[rank][later][1] < opens:
                    later += 1
                if later != index:
                    rank_gaps[index].remove(op)
                    rank_gaps[later].append(op)


def _assemble(
    gaps: dict[int, list[list[Send | Recv]]], steps: dict[int, list[list[Compute]]], pp: int
) -> Table:
    """The table: gap, step, gap, ... with each gap's sends first, then its receives, each sorted
    by the partner's batch, then by what it carries."""
    batch_of = {
        (rank, transfer_of(rank, op, pp)): index
        for rank, rank_gaps in gaps.items()
        for index, gap in enumerate(rank_gaps)
        for op in gap
    }
    table: Table = {}
    for rank, rank_gaps in gaps.items():
        actions: list[Action] = []
        for index, gap in enumerate(rank_gaps):
            actions += sorted(
                gap,
                key=lambda op, rank=rank: (
                    isinstance(op, RecvActivation | RecvGrad),
                    batch_of.get((op.peer, transfer_of(rank, op, pp)), 0),
                    transfer_of(rank, op, pp),
                ),
            )
            if index < len(steps[rank]):
                actions += steps[rank][index]
        table[rank] = actions
    return table


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
