"""``mega schedule``: print a pipeline schedule's timeline and its simulated bubble.

``mega schedule --pp 4 --vpp 2 --microbatches 8 --schedule interleaved [--num-layers L]
[--forward-cost 1 --backward-cost 1] [--png FILE] [--width COLS]`` builds the table, simulates it
(which proves it finishes and respects its dependencies), prints one timeline row per rank and the
bubble fraction: simulated, and the closed form where there is one. Pure Python: no torch.
"""

from __future__ import annotations

import shutil

import click

from mega import hookimpl
from mega.core.errors import MegaRunError, MegaUsageError

DEFAULT_WIDTH = 100


def _analytic_text(name: str, pp: int, vpp: int, m: int) -> str | None:
    from mega.plugins.parallel.pipeline import analytic_bubble

    value = analytic_bubble(name, pp, vpp, m)
    if value is None:
        return None
    formula = "(p-1)/(v*m+p-1)" if vpp > 1 else "(p-1)/(m+p-1)"
    return f"{formula} = {value:.4f}"


@click.command("schedule")
@click.option(
    "--schedule",
    "--parallel",
    "name",
    default=None,
    help="Schedule table: gpipe, 1f1b, interleaved (default: interleaved if --vpp > 1, else 1f1b).",
)
@click.option(
    "--pp",
    "--pipeline-model-parallel-size",
    "pp",
    type=int,
    default=4,
    show_default=True,
    help="Pipeline ranks.",
)
@click.option(
    "--vpp",
    "--virtual-pipeline-model-parallel-size",
    "vpp",
    type=int,
    default=1,
    show_default=True,
    help="Model chunks per rank (virtual stages).",
)
@click.option(
    "--microbatches",
    "-m",
    "microbatches",
    type=int,
    default=None,
    help="Micro-batches per global batch (default: 2 x pp).",
)
@click.option(
    "--num-layers",
    type=int,
    default=None,
    help="Also check that this many layers split evenly over pp x vpp stages.",
)
@click.option(
    "--forward-cost",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Time of one forward of one chunk.",
)
@click.option(
    "--backward-cost",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Time of one backward of one chunk.",
)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also draw the timeline into this PNG file.",
)
@click.option(
    "--width",
    type=click.IntRange(min=20),
    default=None,
    help="Columns of the text timeline (default: the terminal's width, else 100).",
)
def schedule_command(
    name: str | None,
    pp: int,
    vpp: int,
    microbatches: int | None,
    num_layers: int | None,
    forward_cost: float,
    backward_cost: float,
    png_path: str | None,
    width: int | None,
) -> None:
    """Print a pipeline schedule per rank and its simulated bubble.

    The simulation proves the table finishes and respects its dependencies. Each cell is one
    time slot: F3 / B3 is the forward / backward of micro-batch 3 (F3.1: of chunk 1), '.' idle.

    \b
    Example:
      mega schedule --pp 4 --vpp 2 --microbatches 8 --schedule interleaved --png sched.png
    """
    from mega.plugins.parallel.pipeline import (
        ScheduleError,
        build_table,
        simulate,
        table_problems,
    )
    from mega.plugins.parallel.pipeline.render import render_text

    name = name or ("interleaved" if vpp > 1 else "1f1b")
    m = 2 * pp if microbatches is None else microbatches
    problems = table_problems(name, pp, vpp, m, num_layers)
    if problems:
        raise MegaUsageError(problems)
    try:
        result = simulate(build_table(name, pp, vpp, m), pp, vpp, m, forward_cost, backward_cost)
    except ScheduleError as exc:  # a table that cannot run is the table's bug, not bad input
        raise MegaRunError(f"schedule '{name}' does not run: {exc}") from None
    chunks = f"{vpp} chunks" if vpp > 1 else "1 chunk"
    click.echo(
        f"{name}: {pp} pipeline ranks x {chunks}, {m} micro-batches;"
        f" forward {forward_cost:g}, backward {backward_cost:g} per chunk"
    )
    columns = width or shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    click.echo(render_text(result, columns))
    busy = sum(slot.end - slot.start for slots in result.timelines.values() for slot in slots)
    line = (
        f"bubble: {result.bubble_fraction:.4f} simulated"
        f" (time {result.total_time:g} per rank, {busy / pp:g} busy on average)"
    )
    analytic = _analytic_text(name, pp, vpp, m)
    if analytic:
        line += f"; analytic {analytic}"
    click.echo(line)
    if png_path:
        from mega.plugins.parallel.pipeline.png import write_timeline_png

        try:
            write_timeline_png(result, png_path)
        except OSError as exc:
            raise MegaUsageError(f"--png {png_path}: {exc.strerror or exc}") from None
        click.echo(f"wrote {png_path}")


@hookimpl
def register_commands(register) -> None:
    register(schedule_command)
