"""A simulated schedule drawn with matplotlib: one lane per pipeline rank, time to the right.

Each compute is a box labelled as in the text timeline (``F3``, ``B3``, ``W3``; ``F3.1`` for
chunk 1 when ``vpp > 1``), coloured by its micro-batch (hues spread by the golden ratio):
forwards light, backwards dark, split-off weight gradients between. With several chunks, later
chunks get a hatched box. Ranks are labelled on the y axis (rank 0 on top); the x axis is time in
the units of ``--forward-cost``/``--backward-cost``. A label that does not fit its box is left
out (the box stays). The caller makes the ``Figure`` (so this module never imports matplotlib).
"""

from __future__ import annotations

import colorsys
from typing import Any

from mega.parallel.pipeline.actions import label
from mega.parallel.pipeline.simulator import SimulationResult

GOLDEN = 0.618033988749895
INCH_PER_TIME = 0.42  # horizontal size of one time unit, within the bounds below
MIN_WIDTH, MAX_WIDTH = 8.0, 60.0  # inches
LANE_HEIGHT = 0.55  # inches per rank
FONT_SIZE = 8.0  # points
CHAR_WIDTH = 0.62  # of the font size, for a label's width


def action_colour(microbatch: int, kind: str) -> tuple[float, float, float]:
    """Light for a forward (``"F"``), dark for a backward (``"B"``), between for its split-off
    weight gradients (``"W"``); the hue set by the micro-batch."""
    hue = (microbatch * GOLDEN) % 1.0
    saturation, value = {"F": (0.35, 0.97), "B": (0.85, 0.62), "W": (0.6, 0.8)}[kind]
    return colorsys.hsv_to_rgb(hue, saturation, value)


def draw_timeline(figure: Any, result: SimulationResult, title: str) -> Any:
    """Draw ``result`` on ``figure`` (sized here); returns the axes."""
    from matplotlib.patches import Patch

    total = result.total_time or 1.0
    width = min(MAX_WIDTH, max(MIN_WIDTH, 1.5 + total * INCH_PER_TIME))
    height = 1.4 + result.pp * LANE_HEIGHT
    figure.set_size_inches(width, height)
    axes = figure.add_subplot(1, 1, 1)
    points_per_time = (width - 1.5) * 72 / total
    for rank in range(result.pp):
        axes.broken_barh([(0, total)], (rank - 0.4, 0.8), facecolors="#eeeeee")
        for slot in result.timelines.get(rank, []):
            action, duration = slot.action, slot.end - slot.start
            text = label(action, result.vpp)
            kind = text[0]
            axes.broken_barh(
                [(slot.start, duration)],
                (rank - 0.4, 0.8),
                facecolors=[action_colour(action.microbatch, kind)],
                edgecolors="white",
                linewidth=0.8,
                hatch="//" if result.vpp > 1 and action.chunk % 2 else None,
            )
            if duration * points_per_time >= len(text) * FONT_SIZE * CHAR_WIDTH + 2:
                axes.text(
                    slot.start + duration / 2,
                    rank,
                    text,
                    ha="center",
                    va="center",
                    fontsize=FONT_SIZE,
                    color="white" if kind == "B" else "black",
                )
    axes.set_ylim(result.pp - 0.5, -0.5)  # rank 0 on top
    axes.set_yticks(range(result.pp), [f"rank {r}" for r in range(result.pp)])
    axes.set_xlim(0, total)
    axes.set_xlabel("time (units of --forward-cost / --backward-cost)")
    axes.set_title(title, fontsize=10)
    axes.grid(axis="x", color="#bbbbbb", linewidth=0.5, linestyle=":")
    axes.set_axisbelow(True)
    grey = {"F": (0.85, 0.85, 0.85), "B": (0.35, 0.35, 0.35), "W": (0.6, 0.6, 0.6)}
    names = {"F": "F forward", "B": "B backward", "W": "W weight gradients"}
    kinds = {label(s.action)[0] for slots in result.timelines.values() for s in slots}
    handles = [Patch(facecolor=grey[k], label=names[k]) for k in "FBW" if k in kinds]
    if result.vpp > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="odd chunk"))
    axes.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=FONT_SIZE,
        frameon=False,
    )
    return axes
