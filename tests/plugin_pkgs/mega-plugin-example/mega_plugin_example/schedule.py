"""``toy-sequential``: a pipeline schedule with no overlap at all, as a worked example.

Each micro-batch goes forward through every stage and back before the next one starts, so one
rank computes at a time. Rank ``r`` runs ``F0 B0 F1 B1 ...``: the same compute order on every
rank, which ``with_p2p`` turns into a table by putting each receive just before the compute that
needs it and each send just after the compute that produced it. With unit forward and backward
costs a step takes ``2 p`` units of which each rank is busy for 2, so the bubble is ``(p-1)/p``
whatever the number of micro-batches: the schedule is useless for speed, but it keeps one
micro-batch's activations alive (the least of any schedule) and makes a pipeline easy to debug.

Pure Python, like every table builder: mega imports this module on every command and rank.
"""

from __future__ import annotations

from mega import PipelineScheduleSpec
from mega.parallel.pipeline import Backward, Compute, Forward, Table, with_p2p


def sequential_table(pp: int, vpp: int, m: int) -> Table:
    """Every rank: ``Forward(0), Backward(0), Forward(1), Backward(1), ...`` (one chunk)."""
    order: list[Compute] = []
    for mb in range(m):
        order += [Forward(mb), Backward(mb)]
    return with_p2p({rank: list(order) for rank in range(pp)}, pp, vpp)


def sequential_bubble(pp: int, vpp: int, m: int) -> float:
    """Idle fraction with unit costs: ``(p-1)/p`` (each rank works 2 of every 2p time units)."""
    return (pp - 1) / pp


TOY_SEQUENTIAL = PipelineScheduleSpec(
    name="toy-sequential",
    table=sequential_table,
    description="one micro-batch at a time: forward through all stages, then back (example plugin)",
    analytic_bubble=sequential_bubble,
)
