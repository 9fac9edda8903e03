"""``mega train``: Megatron-LM's flags, generated from the config sections of the chosen plugins.

The flags are parsed by ``mega.core.config.resolve`` (not click) because which flags exist depends on the
model, tokenizer and dataset chosen on the same command line.
"""

from __future__ import annotations

from typing import Any

import click

from mega.cli.flag_command import flag_command, warn_failed_plugins

USAGE = """\
Usage: mega train [--model NAME] [--config FILE] [FLAGS...]

Train a model. Flags are Megatron-LM's; a --config TOML/YAML file sets the same keys
(flags override it). Plugin options appear once the plugin is selected, e.g.
`mega train --model gpt --help`."""


def _help_sections(args: list[str], plugins: Any) -> tuple[str, dict[str, type]]:
    """The usage and every flag section of ``mega train`` for the plugins these args select."""
    from mega.core.config.resolve import (
        DEFAULT_MODEL,
        dataset_tokenizer,
        plugin_choice,
        scan_selectors,
    )
    from mega.core.config.sections import CORE_SECTIONS

    selectors = scan_selectors(args)
    model_dataset = lambda name: (  # noqa: E731
        plugins.models.get(name).default_dataset if name in plugins.models else None
    )
    model, dataset, tokenizer = plugin_choice(selectors, model_dataset=model_dataset)
    sections: dict[str, type] = {}
    if model in plugins.models:
        sections["model"] = plugins.models.get(model).config_cls
    if dataset in plugins.datasets:
        spec = plugins.datasets.get(dataset)
        sections["dataset"] = spec.config_cls
        tokenizer = tokenizer or dataset_tokenizer(spec, selectors)
        if tokenizer in plugins.tokenizers:
            sections["tokenizer"] = plugins.tokenizers.get(tokenizer).config_cls
    sections.update(CORE_SECTIONS)
    intro = "\n".join(
        [
            USAGE,
            "",
            f"  --model NAME   model plugin (default {DEFAULT_MODEL};"
            f" available: {', '.join(plugins.models)})",
            "  --config FILE  TOML or YAML config file",
        ]
    )
    return intro, sections


@flag_command("train", _help_sections, warn_failures=False)
def train_command(args_list: list[str], plugins: Any) -> None:
    """Train a model (Megatron-LM flags; `mega train --help` lists them)."""
    from mega.cli import launch
    from mega.core.config.resolve import resolve_config
    from mega.errors import MegaUsageError
    from mega.parallel.distributed import process_place

    try:
        place = process_place()  # torchrun's or SLURM's variables, if either started us
    except ValueError as exc:  # e.g. a SLURM_JOB_NODELIST that cannot be read
        raise MegaUsageError(str(exc)) from None
    # Every rank loads the same plugins and reads the same flags: one copy of these warnings
    # (rank 0's, or the launching parent's, whose workers then stay quiet) is enough.
    speaks = place.rank == 0 and not launch.is_launched_worker()
    if speaks:
        warn_failed_plugins(plugins)
    config = resolve_config(args_list, plugins)  # every config error, before torch is touched
    if speaks:  # one process checks, before any rank writes into the directories
        from mega.core.checkpoint.existing_run import existing_run_problems

        problems = existing_run_problems(config)
        if problems:
            raise MegaUsageError(problems)
    asked = config.launch.world_size
    if speaks and place.source != "single" and asked not in (1, place.world_size):
        click.echo(
            f"warning: --nproc-per-node x --nnodes ({asked}) ignored: {place.source} started"
            f" this job's {place.world_size} processes",
            err=True,
        )
    if launch.needs_launch(config):
        # --nproc-per-node/--nnodes and no torchrun/SLURM around us: start the workers, which run
        # this same command (they see RANK etc., so they train instead of launching)
        try:
            launch.launch_workers(config, args_list)
        except KeyboardInterrupt:  # rank 0 has said where it stopped: exit 130, no blank line
            raise click.exceptions.Exit(130) from None
        return

    from mega.core.training.engine import Engine
    from mega.parallel.distributed import finish_job, leave_job

    try:
        Engine(config, plugins).train()
        finish_job()
    except KeyboardInterrupt:  # the engine has said where it stopped: exit 130, no blank line
        raise click.exceptions.Exit(130) from None
    finally:
        leave_job()
