"""Pipeline schedules as data: action tables, the built-in GPipe/1F1B/interleaved tables, and a
simulator that proves a table finishes, checks its dependencies and computes its bubble.

Pure Python (no torch): ``mega schedule`` and the checks before a launch use it. The executor that
runs a table on real stages lives elsewhere; ``actions.py`` states the semantics it implements.
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
    label,
    stage_place,
    virtual_stage,
)
from mega.plugins.parallel.pipeline.registry import (
    SCHEDULE_TABLES,
    TableSpec,
    analytic_bubble,
    build_table,
    minimum_microbatches,
    register_table,
    table_problems,
    table_spec,
)
from mega.plugins.parallel.pipeline.simulate import (
    ScheduleError,
    SimulationResult,
    Slot,
    check_table,
    simulate,
)

__all__ = [
    "SCHEDULE_TABLES",
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
    "TableSpec",
    "analytic_bubble",
    "build_table",
    "check_table",
    "label",
    "minimum_microbatches",
    "register_table",
    "simulate",
    "stage_place",
    "table_problems",
    "table_spec",
    "virtual_stage",
]
