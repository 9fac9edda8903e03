"""Deprecated: moved to ``mega.core.schedules.learning_rate`` (2026-11-29)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.core.schedules.learning_rate",
    ["LRSchedule", "resolve_warmup_iters", "validate_schedule_args"],
    since="2026-11-29",
)
