"""Pipeline parallelism: schedules as data, and the machinery that runs them.

One file per job: ``actions`` (what a table is made of and what each action means), ``placement``
(``with_p2p``: sends and receives around a compute order), ``tables`` (GPipe, 1F1B, interleaved,
their zero-bubble variants, no pipelining), ``simulator`` (``simulate``: proves a table finishes, computes its
bubble), ``schedules`` (looking schedules up in the registry, the checks before a launch),
``layout`` (which layers each virtual stage holds), ``setup`` (the run's schedule and layout from
its config), ``split`` (cutting a built model into this rank's chunks), ``executor`` (runs any
table on real stages), ``render``/``timeline_plot`` (pictures of a simulated table).

Importing this package does not import torch: ``mega schedule`` and the checks before a launch use
the table side; ``PipelineExecutor`` and ``split_for_pipeline`` load torch on first use.
"""

from __future__ import annotations

from typing import Any

# Every name loads on first use: plugin discovery imports this package (the built-in schedules'
# tables), and ``mega --help`` should not pay for the simulator, the layout rules or torch.
_LAZY = {
    "Action": "mega.parallel.pipeline.actions",
    "Backward": "mega.parallel.pipeline.actions",
    "Compute": "mega.parallel.pipeline.actions",
    "Forward": "mega.parallel.pipeline.actions",
    "P2P_MODES": "mega.parallel.pipeline.simulator",
    "PipelineExecutor": "mega.parallel.pipeline.executor",
    "PipelineLayout": "mega.parallel.pipeline.layout",
    "PipelineSetup": "mega.parallel.pipeline.setup",
    "RecvActivation": "mega.parallel.pipeline.actions",
    "RecvGrad": "mega.parallel.pipeline.actions",
    "ScheduleError": "mega.parallel.pipeline.simulator",
    "SendActivation": "mega.parallel.pipeline.actions",
    "SendGrad": "mega.parallel.pipeline.actions",
    "SimulationResult": "mega.parallel.pipeline.simulator",
    "Slot": "mega.parallel.pipeline.simulator",
    "Table": "mega.parallel.pipeline.actions",
    "WeightGrad": "mega.parallel.pipeline.actions",
    "build_table": "mega.parallel.pipeline.schedules",
    "check_table": "mega.parallel.pipeline.simulator",
    "fifo_problems": "mega.parallel.pipeline.simulator",
    "label": "mega.parallel.pipeline.actions",
    "p2p_batches": "mega.parallel.pipeline.actions",
    "pipeline_schedules": "mega.parallel.pipeline.schedules",
    "pipeline_setup": "mega.parallel.pipeline.setup",
    "schedule_spec": "mega.parallel.pipeline.schedules",
    "simulate": "mega.parallel.pipeline.simulator",
    "split_for_pipeline": "mega.parallel.pipeline.split",
    "split_weight_grads": "mega.parallel.pipeline.actions",
    "stage_place": "mega.parallel.pipeline.actions",
    "table_problems": "mega.parallel.pipeline.schedules",
    "virtual_stage": "mega.parallel.pipeline.actions",
    "with_p2p": "mega.parallel.pipeline.placement",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
