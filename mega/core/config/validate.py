"""The checks of a resolved config that need more than one section, and each section's own
``validate()``: every problem is collected, so one run of ``mega train`` lists them all."""

from __future__ import annotations

from typing import Any

from mega.core.checkpoint.store import validate_checkpoint_dirs
from mega.core.config.run_checks import run_problems, schedule_inputs_ok
from mega.core.config.sections import RunConfig
from mega.core.plugins.manager import Plugins
from mega.core.schedules.learning_rate import validate_schedule_args
from mega.core.schedules.samples import sample_schedule_problems, schedule_lengths
from mega.errors import MegaUsageError
from mega.parallel.checks import parallel_problems
from mega.parallel.distributed import process_place
from mega.parallel.pipeline.schedules import NO_MICROBATCHES


def validate_run(config: RunConfig, plugins: Plugins, this_machine: bool = True) -> list[str]:
    """Every problem of ``config``, one line each (empty when it can run); with
    ``this_machine``, including whether this machine has the devices it asks for."""
    errors: list[str] = []
    for section in config.sections().values():
        check = getattr(section, "validate", None)
        if callable(check):
            errors += check()
    t = config.training
    if t.micro_batch_size < 1 or (t.global_batch_size is not None and t.global_batch_size < 1):
        # reported by the training section; every later check counts micro-batches in them
        return errors
    layout_problems = parallel_problems(config, plugins)
    dp = config.data_parallel_size
    if config.global_batch_size % (t.micro_batch_size * dp):
        # a global batch smaller than one micro-batch per DP rank also leaves the schedule no
        # micro-batch: one cause, said once
        layout_problems = [p for p in layout_problems if p != NO_MICROBATCHES.format(0)]
        layout_problems.append(
            f"--global-batch-size ({config.global_batch_size}) must be divisible by"
            f" --micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})"
        )
    errors += layout_problems
    s = config.scheduler
    sample_problems = sample_schedule_problems(config)
    errors += sample_problems
    # schedule_inputs_ok: a bad --lr or --train-iters is reported once, by its own section
    if not sample_problems and schedule_inputs_ok(config):  # in iterations, or samples
        errors += validate_schedule_args(
            lr=config.optimizer.lr,
            min_lr=config.optimizer.min_lr,
            decay_style=s.lr_decay_style,
            train_iters=config.train_iters,
            warmup_fraction=s.lr_warmup_fraction,
            warmup_init=s.lr_warmup_init,
            wsd_decay_style=s.lr_wsd_decay_style,
            **schedule_lengths(config),
        )
    for registry, name in (
        (plugins.checkpoint_backends, config.checkpoint.ckpt_format),
        (plugins.parallel, config.parallel.parallel),
        (plugins.optimizers, config.optimizer.optimizer),
    ):
        try:
            registry.get(name)  # a schedule's own checks are pipeline_setup's
        except MegaUsageError as exc:
            errors += exc.messages
    errors += _state_dtype_problems(config.optimizer, plugins)
    errors += validate_checkpoint_dirs(config.checkpoint)
    errors += run_problems(config, plugins, this_machine)
    for result in plugins.pm.hook.validate_config(config=config):
        errors += list(result or [])
    return errors


def _state_dtype_problems(optim: Any, plugins: Plugins) -> list[str]:
    """--exp-avg-dtype / --exp-avg-sq-dtype name Adam's moments: a rule without them (sgd)
    would ignore the flag."""
    if optim.optimizer not in plugins.optimizers:
        return []  # said by the registry
    states = plugins.optimizers.peek(optim.optimizer).states
    return [
        f"--{flag} {value}: --optimizer {optim.optimizer} keeps no {state}"
        for flag, value, state in (
            ("exp-avg-dtype", optim.exp_avg_dtype, "exp_avg"),
            ("exp-avg-sq-dtype", optim.exp_avg_sq_dtype, "exp_avg_sq"),
        )
        if value != "fp32" and state not in states
    ]


def job_world_size(launch: Any) -> int:
    """The processes of this job: the launcher's (torchrun, SLURM) if set, else what
    ``--nproc-per-node`` x ``--nnodes`` will start."""
    place = process_place()
    return place.world_size if place.source != "single" else launch.world_size
