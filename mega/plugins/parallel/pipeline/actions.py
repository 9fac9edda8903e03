"""Deprecated: moved to ``mega.parallel.pipeline.actions`` (``with_p2p`` to
``mega.parallel.pipeline.placement``); schedule authors import them from ``mega``."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.parallel.pipeline",
    [
        "Forward",
        "Backward",
        "WeightGrad",
        "SendActivation",
        "RecvActivation",
        "SendGrad",
        "RecvGrad",
        "Compute",
        "Action",
        "Table",
        "virtual_stage",
        "stage_place",
        "label",
        "with_p2p",
        "p2p_batches",
        "split_weight_grads",
    ],
)
