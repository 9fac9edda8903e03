"""Pipeline parallelism: schedules as data, and the machinery that runs them.

One file per job: ``actions`` (what a table is made of and what each action means), ``placement``
(``with_p2p``: sends and receives around a compute order), ``tables`` (GPipe, 1F1B, interleaved,
their zero-bubble variants, no pipelining), ``simulate`` (proves a table finishes, computes its
bubble), ``schedules`` (looking schedules up in the registry, the checks before a launch),
``layout`` (which layers each virtual stage holds), ``setup`` (the run's schedule and layout from
its config), ``split`` (cutting a built model into this rank's chunks), ``executor`` (runs any
table on real stages), ``render``/``timeline_plot`` (pictures of a simulated table).

Importing this package does not import torch: ``mega schedule`` and the checks before a launch use
the table side; ``PipelineExecutor`` and ``split_for_pipeline`` load torch on first use.
"""

from __future__ import annotations

from typing import Any

from mega.parallel.pipeline.actions import (
    Action,
    Backward,
    Compute,
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
)
from mega.parallel.pipeline.layout import PipelineLayout
from mega.parallel.pipeline.placement import with_p2p
from mega.parallel.pipeline.schedules import (
    build_table,
    pipeline_schedules,
    schedule_spec,
    table_problems,
)
from mega.parallel.pipeline.setup import PipelineSetup, pipeline_setup
from mega.parallel.pipeline.simulate import (
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
    "Compute",
    "PipelineExecutor",
    "PipelineLayout",
    "PipelineSetup",
    "pipeline_setup",
    "split_for_pipeline",
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


_LAZY = {  # torch-backed: loaded on first use
    "PipelineExecutor": "mega.parallel.pipeline.executor",
    "split_for_pipeline": "mega.parallel.pipeline.split",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
