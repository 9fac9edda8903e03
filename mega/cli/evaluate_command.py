"""``mega evaluate --load CKPT``: the validation (and test) loss and perplexity of a checkpoint.

As Megatron's ``--skip-train``: the run's saved config is the starting point (model, tokenizer,
data, batch sizes, ``--eval-iters``), so the loss printed is the one the training run's
evaluation after the checkpoint's iteration printed. Any ``mega train`` flag given here wins: the
parallel layout (a sharded checkpoint loads at any layout, ``--nproc-per-node`` starts the
workers), another ``--data-path``, more ``--eval-iters``. Only the weights are loaded.
"""

from __future__ import annotations

import json
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
# flags that choose the data (the evaluation uses only those, not the run's), and what of the
# run's data section still holds for other data: its tokenizer
DATA_FLAGS = (
    "--data-path", "--mock-data", "--train-data-path", "--valid-data-path", "--test-data-path",
)  # fmt: skip
TOKENIZER_KEYS = ("tokenizer_type", "make_vocab_size_divisible_by")


def _help_sections(args: list[str], plugins: Any) -> tuple[str, dict[str, type]]:
    _, sections = _train_help_sections(args, plugins)
    return USAGE, sections


def _flag_value(args: list[str], name: str) -> str | None:
    for i, token in enumerate(args):
        if token == name and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def checkpoint_to_evaluate(args: list[str], plugins: Any) -> tuple[int, dict[str, Any]]:
    """(the iteration, the saved config as a config file's sections) of ``--load``'s checkpoint,
    without the run's data when ``args`` name other data."""
    load = _flag_value(args, "--load")
    from mega.core.checkpoint.checkpoint_args import saved_config
    from mega.core.checkpoint.store import MARKER, find_checkpoint
    from mega.core.errors import MegaUsageError

    if not load:
        raise MegaUsageError("mega evaluate needs --load CHECKPOINT")
    directory = find_checkpoint(load)
    if directory is None:
        raise MegaUsageError(f"--load {load}: no complete checkpoint there")
    try:
        marker = json.loads((directory / MARKER).read_text())
        saved = saved_config(load, plugins.checkpoint_backends) or {}
    except (OSError, ValueError) as exc:
        raise MegaUsageError(f"--load {directory}: unreadable {MARKER} ({exc})") from None
    if not saved.get("model"):
        raise MegaUsageError(f"--load {directory}: the checkpoint holds no saved config")
    base = {name: dict(saved[name]) for name in SAVED_SECTIONS if name in saved}
    if any(_flag_value(args, flag) is not None or flag in args for flag in DATA_FLAGS):
        # other data named here: none of the run's data settings but its tokenizer's
        data = base.get("data", {})
        base["data"] = {k: data[k] for k in TOKENIZER_KEYS if k in data}
        base.pop("dataset", None)
    return int(marker.get("iteration", 0)), base


@flag_command("evaluate", _help_sections, warn_failures=False)
def evaluate_command(args_list: list[str], plugins: Any) -> None:
    """Validation/test loss and perplexity of a checkpoint (mega train's flags)."""
    from mega.cli import launch
    from mega.core.config.resolve import resolve_config
    from mega.core.errors import MegaUsageError

    iteration, base = checkpoint_to_evaluate(args_list, plugins)
    extra = ["--finetune"]  # weights only: no optimizer, no RNG; a converted checkpoint loads
    given = _flag_value(args_list, "--valid-data-path") or _flag_value(
        args_list, "--test-data-path"
    )
    if given and _flag_value(args_list, "--train-data-path") is None:
        # the datasets want a train split; an evaluation never reads it
        extra += ["--train-data-path", given]
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
    from mega.parallel.distributed import leave_job

    try:
        Engine(config, plugins).evaluate_checkpoint(iteration)
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    finally:
        leave_job()


@hookimpl
def register_commands(register: Any) -> None:
    register(evaluate_command)
