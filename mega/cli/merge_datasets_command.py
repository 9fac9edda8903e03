"""``mega merge-datasets``: concatenate ``.bin/.idx`` datasets (Megatron's tools/merge_datasets.py)."""

from __future__ import annotations

from typing import Any

import click

from mega import hookimpl
from mega.cli.flag_command import flag_command

USAGE = """\
Usage: mega merge-datasets --input PREFIX|DIR [PREFIX|DIR ...] --output-prefix OUT

Concatenate Megatron .bin/.idx datasets, in the order given, into OUT.bin/OUT.idx. A directory
stands for every dataset in it, in sorted order (as in Megatron's tools/merge_datasets.py). All
inputs must share one token dtype. OUT appears only when complete."""


def _help_sections(args: list[str], plugins: Any) -> tuple[str, dict[str, type]]:
    from mega.plugins.datasets.preprocess import MergeConfig

    return USAGE, {"merge": MergeConfig}


@flag_command("merge-datasets", _help_sections)
def merge_datasets_command(args_list: list[str], plugins: Any) -> None:
    """Concatenate .bin/.idx datasets into one."""
    from mega.core.config.resolve import parse_sections
    from mega.plugins.datasets.preprocess import MergeConfig, merge_datasets

    config = parse_sections(args_list, {"merge": MergeConfig})["merge"]
    result = merge_datasets(config.input, config.output_prefix)
    click.echo(
        f"merged {len(result.prefixes)} datasets: {result.documents:,} documents,"
        f" {result.sequences:,} sequences, {result.tokens:,} tokens in {result.seconds:.1f} s"
    )
    click.echo(f"wrote {result.output}.bin/.idx ({result.dtype})")


@hookimpl
def register_commands(register) -> None:
    register(merge_datasets_command)
