"""Moved to :mod:`mega.parallel.loss_scaler` on 2026-11-27 (the optimizer below core uses it)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.parallel.loss_scaler",
    ["LossScaler", "ConstantLossScaler", "DynamicLossScaler", "found_inf_or_nan", "unscale_"],
    since="2026-11-27",
)
