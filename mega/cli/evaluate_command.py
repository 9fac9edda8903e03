"""``mega evaluate --load CKPT``: the validation (and test) loss and perplexity of a checkpoint.

As Megatron's ``--skip-train``: the run's saved config is the starting point (model, tokenizer,
data, batch sizes, ``--eval-iters``), so the loss printed is the one the training run's
evaluation after the checkpoint's iteration printed. Any ``mega train`` flag given here wins: the
parallel layout (a sharded checkpoint loads at any layout, ``--nproc-per-node`` starts the
workers), another ``--data-path``, more ``--eval-iters``. Only the weights are loaded.
"""

from __future__ import annotations

from typing import Any

import click

from mega import hookimpl
from mega.cli.flag_command import flag_command
from mega.cli.train_command import _help_sections as _train_help_sections

USAGE = """\
Usage: mega evaluate --load CHECKPOINT [FLAGS...]

Validation and test loss (and perplexity) of a checkpoint on its run's data, or on the data
the flags name. The checkpoint's saved config gives every setting not given here; the flags
are mega train's (e.g. --tensor-model-parallel-size 2 --nproc-per-node 2, --eval-iters 20,
--data-path other_text_document)."""

# sections of the saved config that describe the run, not where or how it ran: the layout, the
# launch, the checkpoint and logging paths are this command's own
SAVED_SECTIONS = (
    "model", "tokenizer", "dataset", "data", "training", "optimizer", "scheduler", "precision",
)  # fmt: skip
# data settings that choose the data: given as flags, the evaluation uses those, and of the run's
# data section only what holds for other data too: its tokenizer
DATA_CHOICE = ("data_path", "mock_data", "train_data_path", "valid_data_path", "test_data_path")
TOKENIZER_KEYS = ("tokenizer_type", "make_vocab_size_divisible_by")


def _help_sections(args: list[str], plugins: Any) -> tuple[str, dict[str, type]]:
    _, sections = _train_help_sections(args, plugins)
    return USAGE, sections


def _given(args: list[str]) -> dict[str, dict[str, Any]]:
    """The checkpoint and data flags among ``args``, parsed as mega train parses them (the other
    flags are left to ``resolve_config`` to check)."""
    from mega.core.config.flags import FlagTable
    from mega.core.config.sections import CheckpointConfig, DataConfig

    values, _ = FlagTable({"checkpoint": CheckpointConfig, "data": DataConfig}).parse(args)
    return values


def checkpoint_to_evaluate(
    load: str | None, other_data: bool, plugins: Any
) -> tuple[int, dict[str, Any]]:
    """(the iteration, the saved config as a config file's sections) of the checkpoint ``load``
    names; without the run's data (but with its tokenizer) when ``other_data``."""
    from mega.core.checkpoint.checkpoint_args import saved_config
    from mega.core.checkpoint.store import MARKER, find_checkpoint, peek_marker
    from mega.errors import MegaUsageError

    if not load:
        raise MegaUsageError("mega evaluate needs --load CHECKPOINT")
    if find_checkpoint(load) is None:
        raise MegaUsageError(f"--load {load}: no complete checkpoint there")
    found = peek_marker(load)
    if found is None:
        raise MegaUsageError(f"--load {load}: its {MARKER} is unreadable")
    directory, marker = found
    saved = saved_config(load, plugins.checkpoint_backends) or {}
    if not saved.get("model"):
        raise MegaUsageError(f"--load {directory}: the checkpoint holds no saved config")
    base = {name: dict(saved[name]) for name in SAVED_SECTIONS if name in saved}
    if other_data:
        data = base.get("data", {})
        base["data"] = {k: data[k] for k in TOKENIZER_KEYS if k in data}
        base.pop("dataset", None)
    return int(marker.get("iteration", 0)), base


@flag_command("evaluate", _help_sections, warn_failures=False)
def evaluate_command(args_list: list[str], plugins: Any) -> None:
    """Validation/test loss and perplexity of a checkpoint (mega train's flags)."""
    from mega.cli import launch
    from mega.core.config.resolve import resolve_config
    from mega.errors import MegaUsageError

    given = _given(args_list)
    data = given.get("data", {})
    other_data = any(key in data for key in DATA_CHOICE)
    iteration, base = checkpoint_to_evaluate(
        given.get("checkpoint", {}).get("load"), other_data, plugins
    )
    extra = ["--finetune"]  # weights only: no optimizer, no RNG; a converted checkpoint loads
    held_out = data.get("valid_data_path") or data.get("test_data_path")
    if held_out and not data.get("train_data_path"):
        # the datasets want a train split; an evaluation never reads it
        extra += ["--train-data-path", *held_out]
    config = resolve_config([*args_list, *extra], plugins, base=base)
    if not config.training.eval_iters:
        raise MegaUsageError("--eval-iters 0: nothing to evaluate")
    if launch.needs_launch(config):
        try:
            launch.launch_workers(config, args_list, command="evaluate")
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
        return

    from mega.core.training.engine import Engine
    from mega.parallel.distributed import finish_job, leave_job

    try:
        Engine(config, plugins).evaluate_checkpoint(iteration)
        finish_job()
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    finally:
        leave_job()


@hookimpl
def register_commands(register: Any) -> None:
    register(evaluate_command)
