"""Where a table's sends and receives go: ``with_p2p`` turns each rank's compute order into a
complete table, each receive just before the compute that needs it and each send just after the
compute that produced it, grouped into batches that run with eager and rendezvous transfers alike
(``simulate`` checks both). The table builders in ``tables.py`` and plugins' own schedules call it.
"""

from __future__ import annotations

from mega.parallel.pipeline.actions import (
    Action,
    Compute,
    Forward,
    Recv,
    RecvActivation,
    RecvGrad,
    Send,
    SendActivation,
    SendGrad,
    Table,
    stage_place,
    transfer_of,
    virtual_stage,
)
from mega.parallel.pipeline.simulator import rendezvous_delay


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
