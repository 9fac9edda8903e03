"""``mega train``: Megatron-LM's flags, generated from the config sections of the chosen plugins.

The flags are parsed by ``mega.core.config.resolve`` (not click) because which flags exist depends on the
model, tokenizer and dataset chosen on the same command line.
"""

from __future__ import annotations

import click


def _help_text(args: list[str]) -> str:
    """Every flag of ``mega train`` for the model/tokenizer/dataset these args select."""
    from mega.cli import current_plugins
    from mega.core.config.flags import FlagTable
    from mega.core.config.resolve import DEFAULT_MODEL, _scan_selectors
    from mega.core.config.sections import CORE_SECTIONS

    plugins = current_plugins()
    selected = _scan_selectors(args)
    model = selected.get("--model", DEFAULT_MODEL)
    dataset = selected.get("--dataset") or (
        "mock"
        if selected.get("--mock-data")
        else "gpt"
        if selected.get("--data-path")
        else "embedded"
    )
    sections: dict[str, type] = {}
    if model in plugins.models:
        sections["model"] = plugins.models.get(model).config_cls
    if dataset in plugins.datasets:
        spec = plugins.datasets.get(dataset)
        sections["dataset"] = spec.config_cls
        tokenizer = selected.get("--tokenizer-type") or spec.default_tokenizer
        if tokenizer in plugins.tokenizers:
            sections["tokenizer"] = plugins.tokenizers.get(tokenizer).config_cls
    sections.update(CORE_SECTIONS)
    table = FlagTable(sections)
    lines = [
        "Usage: mega train [--model NAME] [--config FILE] [FLAGS...]",
        "",
        "Train a model. Flags are Megatron-LM's; a --config TOML/YAML file sets the same keys",
        "(flags override it). Plugin options appear once the plugin is selected, e.g.",
        "`mega train --model gpt --help`.",
        "",
        f"  --model NAME   model plugin (default {DEFAULT_MODEL}; available: {', '.join(plugins.models)})",
        "  --config FILE  TOML or YAML config file",
    ]
    aliases: dict[str, list[str]] = {}
    for name, flag in table.by_flag.items():
        aliases.setdefault(flag.name, []).append(name)
    current = None
    for flag in table.by_key.values():
        if flag.section != current:
            current = flag.section
            lines += ["", f"{current}:"]
        names = ", ".join(aliases[flag.name])
        shown = ""
        if flag.base_type is not bool:  # switches take no value and show no default
            choices = flag.choices and "{" + ",".join(map(str, flag.choices)) + "}"
            names += " " + (choices or ("VALUE..." if flag.base_type is list else "VALUE"))
            if flag.default not in (None, []):
                shown = f" [default: {flag.default}]"
        lines.append(f"  {names:44s} {flag.help}{shown}")
    return "\n".join(lines)


@click.command(
    "train",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train_command(args: tuple[str, ...]) -> None:
    """Train a model (Megatron-LM flags; `mega train --help` lists them)."""
    args_list = list(args)
    if "--help" in args_list or "-h" in args_list:
        click.echo(_help_text(args_list))
        return
    from mega.cli import current_plugins, launch
    from mega.core.config.resolve import resolve_config
    from mega.core.errors import MegaUsageError
    from mega.parallel.distributed import process_place

    plugins = current_plugins()
    try:
        place = process_place()  # torchrun's or SLURM's variables, if either started us
    except ValueError as exc:  # e.g. a SLURM_JOB_NODELIST that cannot be read
        raise MegaUsageError(str(exc)) from None
    # Every rank loads the same plugins and reads the same flags: one copy of these warnings
    # (rank 0's, or the launching parent's, whose workers then stay quiet) is enough.
    speaks = place.rank == 0 and not launch.is_launched_worker()
    if speaks:
        for info in plugins.failures():
            click.echo(
                f"warning: plugin '{info.name}' ({info.dist}) failed to load: {info.error}",
                err=True,
            )
    config = resolve_config(args_list, plugins)  # every config error, before torch is touched
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
        launch.launch_workers(config, args_list)
        return

    from mega.core.training.engine import Engine
    from mega.parallel.distributed import leave_job

    try:
        Engine(config, plugins).train()
    finally:
        leave_job()
