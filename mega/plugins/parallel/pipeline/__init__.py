"""Pipeline schedules as data: action tables, the built-in GPipe/1F1B/interleaved tables, and a
simulator that proves a table finishes, checks its dependencies and computes its bubble.

Pure Python (no torch): ``mega schedule`` and the checks before a launch use it. The executor that
runs a table on real stages lives elsewhere; ``actions.py`` states the semantics it implements,
and ``p2p_batches`` is how it groups a rank's sends and receives. Schedules are
``PipelineScheduleSpec`` plugins (``builtin.py``); ``schedule_spec`` looks one up by name.
"""

from __future__ import annotations

from mega.plugins.parallel.pipeline.actions import (
    Action,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    Table,
    WeightGrad,
    label,
    p2p_batches,
    split_weight_grads,
    stage_place,
    virtual_stage,
    with_p2p,
)
from mega.plugins.parallel.pipeline.registry import (
    build_table,
    pipeline_schedules,
    schedule_spec,
    table_problems,
)
from mega.plugins.parallel.pipeline.simulate import (
    P2P_MODES,
    ScheduleError,
    SimulationResult,
    Slot,
    check_table,
    fifo_problems,
    simulate,
)

__all__ = [
    "P2P_MODES",
    "Action",
    "Backward",
    "Forward",
    "RecvActivation",
    "RecvGrad",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "SimulationResult",
    "Slot",
    "Table",
    "WeightGrad",
    "build_table",
    "check_table",
    "fifo_problems",
    "label",
    "p2p_batches",
    "pipeline_schedules",
    "schedule_spec",
    "simulate",
    "split_weight_grads",
    "stage_place",
    "table_problems",
    "virtual_stage",
    "with_p2p",
]
