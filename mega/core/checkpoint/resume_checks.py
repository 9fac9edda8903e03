"""What ``--load`` compares between a checkpoint and the run that resumes it.

Megatron's rule for the learning-rate schedule: it must match the checkpoint's unless the user
says which one wins. Data-order settings may change, but the user is told: the samples seen
after resuming then differ from the interrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega.errors import MegaUsageError

# (section, key) of the resolved config whose change alters the data a resumed run sees
DATA_ORDER_KEYS = (
    ("training", "seed"),
    ("training", "seq_length"),
    ("training", "global_batch_size"),
    ("training", "micro_batch_size"),
    ("data", "split"),
    ("data", "data_path"),
)


def check_schedule(schedule: Any, saved: dict[str, Any], directory: Path, scheduler: Any) -> None:
    """Raise unless the schedule matches the checkpoint's or --override-opt_param-scheduler."""
    problems = schedule.mismatches(saved)
    if problems and not scheduler.override_opt_param_scheduler:
        raise MegaUsageError(
            f"--load {directory}: the learning-rate schedule differs from the checkpoint's"
            f" ({'; '.join(problems)}). Pass --override-opt_param-scheduler to use the"
            " command line's, or --use-checkpoint-opt_param-scheduler to use the checkpoint's"
        )


def data_order(config: Any) -> dict[str, dict[str, Any]]:
    """The run's data-order settings as it uses them (the global batch size resolved from
    micro-batch x data-parallel size when not given), in ``DATA_ORDER_KEYS``' nesting."""
    out: dict[str, dict[str, Any]] = {}
    for section, key in DATA_ORDER_KEYS:
        value = getattr(getattr(config, section), key)
        if (section, key) == ("training", "global_batch_size"):
            value = config.global_batch_size
        out.setdefault(section, {})[key] = list(value) if isinstance(value, tuple) else value
    return out


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One warning per data-order setting that differs from the checkpoint's: ``saved`` is its
    ``data_order`` (or, from older checkpoints, its resolved config, where unset keys are
    missing), ``now`` this run's ``data_order``."""
    warnings = []
    for section, key in DATA_ORDER_KEYS:
        before, after = saved.get(section, {}).get(key), now.get(section, {}).get(key)
        if before is None or after is None:
            continue  # an old checkpoint that did not record it: nothing to compare with
        if before != after:
            warnings.append(
                f"--{key.replace('_', '-')} is {after!r} but the checkpoint was trained with"
                f" {before!r}: the data seen after resuming differs from the original run"
            )
    return warnings


def nothing_to_train(iteration: int, train_iters: int) -> str | None:
    """The warning for a ``--load`` at or past ``--train-iters``: Megatron's loop then trains no
    step (only evaluates), which would otherwise pass without a word."""
    if iteration < train_iters:
        return None
    return (
        f"the checkpoint is at iteration {iteration} and --train-iters is {train_iters}: nothing"
        " to train (only the evaluation runs); raise --train-iters to train further"
    )
