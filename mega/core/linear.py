"""Deprecated: moved to ``mega.parallel.linear``."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.parallel.linear",
    [
        "Linear",
        "linear",
        "deferring_weight_grads",
        "accumulate_wgrad",
        "WeightGradQueue",
        "register_fused_weight",
    ],
)
