"""The built-in schedules, registered like any plugin's: ``no-pipelining`` (one stage),
``gpipe``, ``1f1b``, ``interleaved``, ``1f1b-zb`` and ``interleaved-zb``. The tables are library
code (``mega.parallel.pipeline.tables``); this plugin names them. Pure Python, cheap to import."""

from __future__ import annotations

from mega import PipelineScheduleSpec, hookimpl
from mega.parallel.pipeline import tables


def one_chunk_bubble(pp: int, vpp: int, m: int) -> float:
    """GPipe's and 1F1B's bubble with unit costs: ``(p-1)/(m+p-1)``."""
    return (pp - 1) / (m + pp - 1)


def interleaved_bubble(pp: int, vpp: int, m: int) -> float | None:
    """Interleaved 1F1B's bubble with unit costs, ``(p-1)/(v m+p-1)``, for ``m >= p``."""
    return (pp - 1) / (vpp * m + pp - 1) if m >= pp or vpp == 1 else None


NO_PIPELINING = PipelineScheduleSpec(
    name="no-pipelining",
    table=tables.sequential,
    description="forward/backward per micro-batch on one model replica (no pipeline)",
    max_pp=1,
)
GPIPE = PipelineScheduleSpec(
    name="gpipe",
    table=tables.gpipe,
    description="all forwards, then all backwards (keeps every micro-batch's activations)",
    analytic_bubble=one_chunk_bubble,
)
ONE_F_ONE_B = PipelineScheduleSpec(
    name="1f1b",
    table=tables.one_f_one_b,
    description="warmup forwards, then one forward one backward (Megatron's default with PP > 1)",
    analytic_bubble=one_chunk_bubble,
)
INTERLEAVED = PipelineScheduleSpec(
    name="interleaved",
    table=tables.interleaved,
    description=(
        "1F1B over vpp model chunks per rank: a bubble vpp times smaller (Megatron's interleaved)"
    ),
    interleaved=True,
    min_pp=2,
    analytic_bubble=interleaved_bubble,
)
ZB_NOTE = (
    ": each backward's weight gradients are split off and run while the next transfers are in"
    " flight, so the previous stage gets its gradient sooner (zero-bubble style; needs"
    " --gradient-accumulation-fusion, else it runs as the plain schedule)"
)
ONE_F_ONE_B_ZB = PipelineScheduleSpec(
    name="1f1b-zb",
    table=tables.one_f_one_b_zero_bubble,
    description="1f1b" + ZB_NOTE,
)
INTERLEAVED_ZB = PipelineScheduleSpec(
    name="interleaved-zb",
    table=tables.interleaved_zero_bubble,
    description="interleaved" + ZB_NOTE,
    interleaved=True,
    min_pp=2,
)
BUILTIN_SCHEDULES = (NO_PIPELINING, GPIPE, ONE_F_ONE_B, INTERLEAVED, ONE_F_ONE_B_ZB, INTERLEAVED_ZB)


@hookimpl
def register_parallel_choices(register) -> None:
    for spec in BUILTIN_SCHEDULES:
        register(spec)
