"""Deprecated: moved to ``mega.core.schedules.samples`` (2026-11-29)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.core.schedules.samples",
    [
        "BatchSchedule",
        "parse_rampup",
        "batch_schedule",
        "train_iters_from_samples",
        "samples_based",
        "schedule_lengths",
        "training_length_problems",
        "sample_schedule_problems",
        "schedule_increment",
    ],
    since="2026-11-29",
)
