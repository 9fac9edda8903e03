"""What a checkpoint holds of a training run, and putting it back: model, optimizer, RNG,
learning-rate schedule, data position and the logging interval, so that the loss curve after a
resume is the one without the interruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega.core.checkpoint.resume_checks import check_schedule, data_changes
from mega.core.config.resolve import resolved_as_dict
from mega.core.console.metrics import IntervalStats
from mega.core.errors import MegaUsageError
from mega.core.training.lr_schedule import LRSchedule
from mega.core.training.rng import capture_rng_state, restore_rng_state

FORMAT = "mega-torch/1"


def training_state(engine: Any) -> dict[str, Any]:
    """The ``Engine``'s state as a checkpoint backend stores it."""
    return {
        "format": FORMAT,
        "iteration": engine.iteration,
        "consumed_samples": engine.consumed_samples,
        "skipped_total": engine.skipped_total,
        "nan_total": engine.nan_total,
        "model": engine.model.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "rng": capture_rng_state(),
        "lr_schedule": engine.lr_schedule.state_dict(),
        "interval": engine.interval.state_dict(),  # so a mid-interval resume logs the same
        "config": resolved_as_dict(engine.config),
    }


def restore_training_state(engine: Any, directory: Path, state: dict[str, Any]) -> None:
    """Put ``state`` (read from ``directory``) back into ``engine``; a checkpoint of another
    model is a ``MegaUsageError``, a changed data or schedule setting a warning or an error."""
    try:
        engine.model.load_state_dict(state["model"])
        engine.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise MegaUsageError(f"--load {directory}: does not match this model ({first})") from None
    s = engine.config.scheduler
    if s.use_checkpoint_opt_param_scheduler:
        engine.lr_schedule = LRSchedule.from_state_dict(state["lr_schedule"])
    else:
        check_schedule(engine.lr_schedule, state["lr_schedule"], directory, s)
    for warning in data_changes(state["config"], resolved_as_dict(engine.config)):
        engine.display.warn(warning)
    restore_rng_state(state["rng"])
    engine.interval = IntervalStats.from_state_dict(state["interval"])
    engine.iteration = int(state["iteration"])
    engine.consumed_samples = int(state["consumed_samples"])
    engine.skipped_total = int(state["skipped_total"])
    engine.nan_total = int(state["nan_total"])
