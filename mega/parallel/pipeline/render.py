"""A simulated schedule as a text timeline: one row per rank, one cell per time slot.

A slot is the largest time step that divides every compute's duration (1 with the default unit
costs and no split-off weight gradients). A compute
action shows its label (``F3``, or ``F3.1`` for micro-batch 3 of chunk 1 when ``vpp > 1``) padded
with ``-`` over its slots; ``.`` is an idle slot. Rows wider than ``width`` are wrapped into blocks
of about equal length, each under a time ruler; past ``max_blocks`` blocks the rest is left out with a note.
"""

from __future__ import annotations

import math
from fractions import Fraction

from mega.parallel.pipeline.actions import WeightGrad, label
from mega.parallel.pipeline.simulator import SimulationResult

MAX_SLOTS = 20_000  # beyond this many slots the time step is coarsened (labels may overlap)


def time_step(result: SimulationResult) -> float:
    """The slot length: the greatest common divisor of the compute durations (as fractions): the
    two costs, and a backward's two parts where weight gradients are split off."""
    b = result.backward_cost
    durations = [result.forward_cost, b]
    if any(isinstance(s.action, WeightGrad) for slots in result.timelines.values() for s in slots):
        durations += [b * result.weight_grad_share, b * (1 - result.weight_grad_share)]
    fractions = [Fraction(d).limit_denominator(1000) for d in durations]
    denominator = math.lcm(*(f.denominator for f in fractions))
    step = float(Fraction(math.gcd(*(int(f * denominator) for f in fractions)), denominator))
    if result.total_time / step > MAX_SLOTS:
        step = result.total_time / MAX_SLOTS
    return step


def rank_rows(result: SimulationResult) -> tuple[dict[int, str], int, int]:
    """Every rank's full row (no wrapping), the cell width and the number of slots."""
    step = time_step(result)
    slots = max(1, round(result.total_time / step))
    labels = {
        (rank, index): label(slot.action, result.vpp)
        for rank, timeline in result.timelines.items()
        for index, slot in enumerate(timeline)
    }
    cell = max((len(text) for text in labels.values()), default=2) + 1
    rows = {}
    for rank, timeline in result.timelines.items():
        row = ["." + " " * (cell - 1)] * slots
        for index, slot in enumerate(timeline):
            first = round(slot.start / step)
            span = max(1, round(slot.end / step) - first)
            text = labels[rank, index].ljust(span * cell - 1, "-") + " "
            for k in range(span):
                if first + k < slots:
                    row[first + k] = text[k * cell : (k + 1) * cell]
        rows[rank] = "".join(row)
    return rows, cell, slots


def _ruler(first: int, last: int, cell: int, step: float, tick: int) -> str:
    """Time marks at every ``tick``-th slot of slots ``first..last-1`` (none may overlap)."""
    ruler = ""
    for index in range(first - first % tick, last, tick):
        if index < first:
            continue
        column = (index - first) * cell
        if len(ruler) < column or column == 0:
            ruler = ruler.ljust(column) + f"{index * step:g}"
    return ruler


def render_text(result: SimulationResult, width: int = 100, max_blocks: int = 12) -> str:
    """The timeline, wrapped to ``width`` columns (at least one slot per line)."""
    rows, cell, slots = rank_rows(result)
    step = time_step(result)
    digits = len(str(max(result.pp - 1, 0)))
    prefix = f"rank {'':>{digits}} |"
    fits = max(1, (width - len(prefix)) // cell)
    per_block = -(-slots // -(-slots // fits))  # blocks of about equal length, none wider than fits
    tick = 5 if 5 * cell >= len(f"{result.total_time:g}") + 1 else 10
    lines: list[str] = []
    blocks = range(0, slots, per_block)
    for number, first in enumerate(blocks):
        if number == max_blocks:
            left = slots - first
            lines.append(
                f"... {left} more time slots left out (widen with --width, or see all with --png)"
            )
            break
        last = min(first + per_block, slots)
        ruler = _ruler(first, last, cell, step, tick)
        if number:
            lines.append("")
        lines.append(f"{'time':<{len(prefix) - 1}}|{ruler}".rstrip())
        for rank in sorted(rows):
            text = rows[rank][first * cell : last * cell]
            lines.append(f"rank {rank:>{digits}} |{text}".rstrip())
    return "\n".join(lines)
