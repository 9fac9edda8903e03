"""``mega plot RUN_DIR [RUN_DIR...]``: a run's curves from its ``metrics.jsonl``, several runs on
the same axes (to compare layouts, or a run with its resumed continuation).

One panel per metric (training loss with the validation points, learning rate, grad norm,
tokens/s), iterations on a shared x axis, one colour per run (the legend names its directory).
A resumed run's ``metrics.jsonl`` is read through its resume markers (``metrics_history``): each
iteration once, the records logged after the restart replacing the abandoned ones; the restart is
a dotted vertical line. PNG, SVG or PDF by the output's suffix; needs matplotlib (``mega[plot]``).
"""

from __future__ import annotations

from pathlib import Path

import click

from mega import hookimpl
from mega.errors import MegaUsageError, unknown_name_message

# name on the command line -> (key in metrics.jsonl, axis label)
METRICS = {
    "loss": ("lm_loss", "lm loss"),
    "lr": ("learning_rate", "learning rate"),
    "grad_norm": ("grad_norm", "grad norm"),
    "tokens_per_s": ("tokens_per_s", "tokens per second"),
}
DEFAULT_METRICS = ",".join(METRICS)
ALIASES = {key: name for name, (key, _) in METRICS.items()}  # lm_loss -> loss, ...


def parse_metrics(text: str, problems: list[str]) -> list[str]:
    """The panels ``--metrics`` names (its errors appended to ``problems``)."""
    names = []
    for raw in (part.strip() for part in text.split(",")):
        name = ALIASES.get(raw, raw)
        if name in METRICS:
            if name not in names:
                names.append(name)
        elif raw:
            problems.append("--metrics: " + unknown_name_message("metric", raw, list(METRICS)))
    if not names and not problems:
        problems.append(f"--metrics: name at least one of {', '.join(METRICS)}")
    return names


def run_labels(runs: list[str]) -> list[str]:
    """Each run's directory name; the path as given where two names would be equal."""
    names = [Path(r).resolve().name if Path(r).name in ("", ".") else Path(r).name for r in runs]
    return [run if names.count(name) > 1 else name for run, name in zip(runs, names, strict=True)]


@click.command("plot")
@click.argument("runs", nargs=-1, required=True, metavar="RUN_DIR [RUN_DIR...]")
@click.option(
    "--output",
    "-o",
    default="metrics.png",
    show_default=True,
    help="The picture to write: .png, .svg or .pdf.",
)
@click.option(
    "--metrics",
    "metrics_text",
    default=DEFAULT_METRICS,
    show_default=True,
    help="Comma-separated panels, from: loss (with validation points), lr, grad_norm, tokens_per_s.",
)
def plot_command(runs: tuple[str, ...], output: str, metrics_text: str) -> None:
    """Plot loss, learning rate, grad norm and tokens/s of one or more runs.

    Each RUN_DIR is a run directory (--run-dir or --save of `mega train`) holding metrics.jsonl,
    or the metrics.jsonl file itself. Several runs share the axes, one colour each.

    \b
    Example:
      mega plot runs/tp1 runs/tp2 --output compare.svg --metrics loss,tokens_per_s
    """
    from mega.cli.plotting import check_writable, new_figure, save_figure
    from mega.core.console.metrics_history import METRICS_FILE, read_history

    problems: list[str] = []
    names = parse_metrics(metrics_text, problems)
    try:
        check_writable("--output", output)
    except MegaUsageError as exc:
        problems += exc.messages
    histories = []
    for run in runs:
        path = Path(run)
        file = path / METRICS_FILE if path.is_dir() else path
        if not file.is_file():
            what = "no such directory" if not path.exists() else f"no {METRICS_FILE} in it"
            problems.append(f"{run}: {what} (give a run directory of `mega train`)")
            continue
        try:
            histories.append(read_history(file))
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"{run}: cannot read {file}: {exc}")
    if problems:
        raise MegaUsageError(problems)
    if not any(h.train for h in histories):
        raise MegaUsageError(f"no iteration records in {', '.join(runs)}: nothing to plot")

    figure = new_figure("mega plot", layout="constrained")
    figure.set_size_inches(9, 2.3 * len(names) + 0.5)
    axes_list = figure.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    labels = run_labels(list(runs))
    colours = [f"C{i % 10}" for i in range(len(runs))]
    drawn = []
    for axes, name in zip(axes_list, names, strict=True):
        key, axis_label = METRICS[name]
        for i, (history, label) in enumerate(zip(histories, labels, strict=True)):
            colour, gid = colours[i], f"run{i}-{name}"  # gid: the element's id in an SVG
            xs, ys = history.series(key)
            if xs:
                axes.plot(xs, ys, color=colour, linewidth=1.2, label=label, gid=gid)
                drawn.append(name)
            if name == "loss":
                vx, vy = history.series("valid_lm_loss")
                if vx:
                    axes.plot(vx, vy, "o", color=colour, markersize=5, markerfacecolor="white",
                              label=f"{label} (validation)", gid=f"{gid}-validation")  # fmt: skip
            for marker in history.resumes:  # where a resumed run restarted
                axes.axvline(marker["iteration"], color=colour, linestyle=":", linewidth=1,
                             gid=f"{gid}-resume")  # fmt: skip
        axes.set_ylabel(axis_label)
        axes.grid(color="#dddddd", linewidth=0.6)
        if axes is axes_list[0] and axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)  # the colours are the same in every panel
    axes_list[-1].set_xlabel("iteration")
    figure.suptitle("mega: " + ", ".join(labels), fontsize=10)
    save_figure(figure, output, "--output")
    empty = [name for name in names if name not in drawn]
    note = f" (no records of {', '.join(empty)})" if empty else ""
    click.echo(f"wrote {output}: {', '.join(names)} of {len(runs)} run(s){note}")


@hookimpl
def register_commands(register) -> None:
    register(plot_command)
