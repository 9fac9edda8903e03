"""The checks of a resolved config that need more than one section, and each section's own
``validate()``: every problem is collected, so one run of ``mega train`` lists them all."""

from __future__ import annotations

from typing import Any

from mega.core.checkpoint.store import validate_checkpoint_dirs
from mega.core.config.sections import RunConfig
from mega.core.errors import MegaUsageError
from mega.core.plugins.manager import Plugins
from mega.core.training.lr_schedule import validate_schedule_args
from mega.parallel.checks import parallel_problems
from mega.parallel.distributed import process_place


def validate_run(config: RunConfig, plugins: Plugins) -> list[str]:
    """Every problem of ``config``, one line each (empty when it can run)."""
    errors: list[str] = []
    for section in config.sections().values():
        check = getattr(section, "validate", None)
        if callable(check):
            errors += check()
    t = config.training
    errors += parallel_problems(config, plugins)
    dp = config.data_parallel_size
    if config.global_batch_size % (t.micro_batch_size * dp):
        errors.append(
            f"--global-batch-size ({config.global_batch_size}) must be divisible by"
            f" --micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})"
        )
    s = config.scheduler
    errors += validate_schedule_args(
        lr=config.optimizer.lr,
        min_lr=config.optimizer.min_lr,
        decay_style=s.lr_decay_style,
        decay_iters=s.lr_decay_iters or t.train_iters,
        train_iters=t.train_iters,
        warmup_iters=s.lr_warmup_iters,
        warmup_fraction=s.lr_warmup_fraction,
        warmup_init=s.lr_warmup_init,
        wsd_decay_style=s.lr_wsd_decay_style,
        wsd_decay_iters=s.lr_wsd_decay_iters,
    )
    for registry, name in (
        (plugins.checkpoint_backends, config.checkpoint.ckpt_format),
        (plugins.parallel, config.parallel.parallel),
    ):
        try:
            registry.get(name)  # a schedule's own checks are pipeline_setup's
        except MegaUsageError as exc:
            errors += exc.messages
    errors += validate_checkpoint_dirs(config.checkpoint)
    for result in plugins.pm.hook.validate_config(config=config):
        errors += list(result or [])
    return errors


def job_world_size(launch: Any) -> int:
    """The processes of this job: the launcher's (torchrun, SLURM) if set, else what
    ``--nproc-per-node`` x ``--nnodes`` will start."""
    place = process_place()
    return place.world_size if place.source != "single" else launch.world_size
