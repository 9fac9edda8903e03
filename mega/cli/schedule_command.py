"""``mega schedule``: print a pipeline schedule's timeline and its simulated bubble.

``mega schedule --pp 4 --vpp 2 --microbatches 8 --schedule interleaved [--num-layers L]
[--forward-cost 1 --backward-cost 1] [--p2p eager|rendezvous] [--png FILE] [--width COLS]`` looks
the schedule up among the registered pipeline schedules (built-in or a plugin's), builds its
table, simulates it (which proves it finishes, respects its dependencies and pairs every send
with its receive in order), prints one timeline row per rank and the bubble fraction: simulated,
and the closed form where there is one. Pure Python: no torch.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import click

from mega import hookimpl
from mega.errors import MegaRunError, MegaUsageError

DEFAULT_WIDTH = 100


def _analytic_text(spec, pp: int, vpp: int, m: int) -> str | None:
    value = spec.analytic_bubble(pp, vpp, m)
    if value is None:
        return None
    return f"{value:.4f}"  # the spec's own closed form, whatever its formula


def _cost_option(flag: str, step: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The simulated time of one ``step`` (forward or backward) of one chunk: the two options
    differ only in the step they time."""
    return click.option(
        flag,
        type=click.FloatRange(min=0, min_open=True),
        default=1.0,
        show_default=True,
        help=f"Time of one {step} of one chunk.",
    )


@click.command("schedule")
@click.option(
    "--schedule",
    "--parallel",
    "name",
    default=None,
    help=(
        "Pipeline schedule: gpipe, 1f1b, interleaved or one a plugin registers"
        " (default: interleaved if --vpp > 1, else 1f1b)."
    ),
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
@_cost_option("--forward-cost", "forward")
@_cost_option("--backward-cost", "backward")
@click.option(
    "--p2p",
    type=click.Choice(["eager", "rendezvous"]),
    default="eager",
    show_default=True,
    help=(
        "Transfer model: eager (a send never waits) or rendezvous (as with NCCL: each run of"
        " sends/receives is one batch that ends once every peer has reached its side)."
    ),
)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False),
    default=None,
    help=(
        "Also draw the timeline into this file: PNG, or SVG/PDF by its suffix (needs matplotlib:"
        " pip install 'mega[plot]')."
    ),
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
    p2p: str,
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
    from mega.cli import current_plugins
    from mega.parallel.pipeline import (
        ScheduleError,
        build_table,
        schedule_spec,
        simulate,
        table_problems,
    )
    from mega.parallel.pipeline.render import render_text

    if png_path:  # before any work: a missing matplotlib or directory is a one-line error
        from mega.cli.plotting import check_writable, new_figure

        check_writable("--png", png_path)
        new_figure("--png")
    plugins = current_plugins()
    spec = schedule_spec(plugins, name or ("interleaved" if vpp > 1 else "1f1b"))
    name = spec.name
    m = 2 * max(pp, 1) if microbatches is None else microbatches  # a bad --pp: one error
    problems = table_problems(spec, pp, vpp, m, num_layers)
    if problems:
        raise MegaUsageError(problems)
    try:
        table = build_table(spec, pp, vpp, m)
        result = simulate(table, pp, vpp, m, forward_cost, backward_cost, p2p=p2p)
    except ScheduleError as exc:  # a table that cannot run is the table's bug, not bad input
        raise MegaRunError(f"schedule '{name}' does not run ({p2p} p2p): {exc}") from None
    chunks = f"{vpp} chunks" if vpp > 1 else "1 chunk"
    click.echo(
        f"{name}: {pp} pipeline ranks x {chunks}, {m} micro-batches;"
        f" forward {forward_cost:g}, backward {backward_cost:g} per chunk"
    )
    columns = width or shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    click.echo(render_text(result, columns))
    click.echo(
        f"checked: finishes with {p2p} p2p, every dependency met, sends match receives in order"
    )
    busy = sum(slot.end - slot.start for slots in result.timelines.values() for slot in slots)
    line = (
        f"bubble: {result.bubble_fraction:.4f} simulated"
        f" (time {result.total_time:g} per rank, {busy / pp:g} busy on average)"
    )
    analytic = _analytic_text(spec, pp, vpp, m)
    if analytic:
        line += f"; analytic {analytic}"
    click.echo(line)
    if png_path:
        from mega.cli.plotting import new_figure, save_figure
        from mega.parallel.pipeline.timeline_plot import draw_timeline

        figure = new_figure("--png")
        title = (
            f"{name}: {pp} pipeline ranks x {chunks}, {m} micro-batches, {p2p} p2p;"
            f" bubble {result.bubble_fraction:.4f}"
        )
        draw_timeline(figure, result, title)
        save_figure(figure, png_path, "--png")
        click.echo(f"wrote {png_path}")


@hookimpl
def register_commands(register) -> None:
    register(schedule_command)
