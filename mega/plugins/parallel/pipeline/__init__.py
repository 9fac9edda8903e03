"""Deprecated: the pipeline schedule machinery moved to ``mega.parallel.pipeline`` (schedule
authors import the actions, ``with_p2p`` and ``simulate`` from ``mega``)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.parallel.pipeline",
    [
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
    ],
)
