"""Schedule tables by name, what they need, and the checks to run before a launch.

``SCHEDULE_TABLES`` maps a schedule name to its ``TableSpec``. The built-ins are ``gpipe``,
``1f1b`` and ``interleaved``; ``register_table`` adds one (a third-party plugin's table goes
through it once the parallel registry is wired to it). Everything here is pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mega.core.errors import unknown_name_message
from mega.plugins.parallel.pipeline import tables
from mega.plugins.parallel.pipeline.actions import Table

PP_FLAG = "--pipeline-model-parallel-size"
VPP_FLAG = "--virtual-pipeline-model-parallel-size"
VPP_LAYERS_FLAG = "--num-layers-per-virtual-pipeline-stage"


@dataclass(frozen=True)
class TableSpec:
    """A named schedule table.

    ``build(pp, vpp, m)`` returns the table. ``min_microbatches(pp, vpp)`` is the fewest
    micro-batches the table runs with. ``analytic_bubble(pp, vpp, m)`` is the closed-form bubble
    fraction for unit forward and backward costs, or None where there is none.
    """

    name: str
    build: Callable[[int, int, int], Table]
    description: str
    interleaved: bool = False  # runs several model chunks per rank (vpp > 1)
    min_pp: int = 1
    min_microbatches: Callable[[int, int], int] = lambda pp, vpp: 1
    analytic_bubble: Callable[[int, int, int], float | None] = lambda pp, vpp, m: None


def _one_chunk_bubble(pp: int, vpp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)


def _interleaved_bubble(pp: int, vpp: int, m: int) -> float | None:
    return (pp - 1) / (vpp * m + pp - 1) if m >= pp or vpp == 1 else None


SCHEDULE_TABLES: dict[str, TableSpec] = {}


def register_table(spec: TableSpec) -> None:
    """Add a schedule table; a name can be registered once."""
    if spec.name in SCHEDULE_TABLES:
        raise ValueError(f"schedule table '{spec.name}' is already registered")
    SCHEDULE_TABLES[spec.name] = spec


register_table(
    TableSpec(
        "gpipe",
        tables.gpipe,
        "all forwards, then all backwards (keeps every micro-batch's activations)",
        analytic_bubble=_one_chunk_bubble,
    )
)
register_table(
    TableSpec(
        "1f1b",
        tables.one_f_one_b,
        "warmup forwards, then one forward one backward (Megatron's default with PP > 1)",
        analytic_bubble=_one_chunk_bubble,
    )
)
register_table(
    TableSpec(
        "interleaved",
        tables.interleaved,
        "1F1B over vpp model chunks per rank: a bubble vpp times smaller (Megatron's interleaved)",
        interleaved=True,
        min_pp=2,
        analytic_bubble=_interleaved_bubble,
    )
)


def table_spec(name: str) -> TableSpec:
    """The spec called ``name``; ``KeyError`` with a did-you-mean message otherwise."""
    if name not in SCHEDULE_TABLES:
        raise KeyError(unknown_name_message("pipeline schedule", name, SCHEDULE_TABLES))
    return SCHEDULE_TABLES[name]


def minimum_microbatches(name: str, pp: int, vpp: int) -> int:
    """The fewest micro-batches per global batch that schedule ``name`` runs with."""
    return table_spec(name).min_microbatches(pp, vpp)


def analytic_bubble(name: str, pp: int, vpp: int, m: int) -> float | None:
    """The closed-form bubble fraction of ``name`` with unit costs, where there is one."""
    return table_spec(name).analytic_bubble(pp, vpp, m)


def _layer_hint(num_layers: int, stages: int) -> str:
    below = num_layers // stages * stages
    above = below + stages
    return f"{below} or {above}" if below > 0 else f"{above}"


def table_problems(
    name: str, pp: int, vpp: int, m: int, num_layers: int | None = None
) -> list[str]:
    """Why ``name`` cannot run with these sizes, one actionable line each (empty when it can)."""
    if name not in SCHEDULE_TABLES:
        return [unknown_name_message("pipeline schedule", name, SCHEDULE_TABLES)]
    spec = SCHEDULE_TABLES[name]
    problems = []
    if pp < spec.min_pp:
        problems.append(f"{PP_FLAG} must be at least {spec.min_pp} for '{name}' (got {pp})")
    if vpp < 1:
        problems.append(f"{VPP_FLAG} must be at least 1 (got {vpp})")
    elif vpp > 1 and not spec.interleaved:
        problems.append(
            f"'{name}' runs one model chunk per rank, but {VPP_FLAG} is {vpp}: use"
            f" --parallel interleaved, or drop {VPP_FLAG}/{VPP_LAYERS_FLAG}"
        )
    if m < 1:
        problems.append(f"the number of micro-batches must be at least 1 (got {m})")
    if problems:
        return problems
    needed = spec.min_microbatches(pp, vpp)
    if m < needed:
        problems.append(
            f"'{name}' with {PP_FLAG} {pp} needs at least {needed} micro-batches per global batch,"
            f" got {m} (= --global-batch-size / (--micro-batch-size x data-parallel size))"
        )
    if num_layers is not None:
        stages = pp * vpp
        if num_layers < 1:
            problems.append(f"--num-layers must be at least 1 (got {num_layers})")
        elif num_layers % stages:
            split = f"{PP_FLAG} ({pp})"
            if vpp > 1:
                split = (
                    f"{PP_FLAG} x virtual stages per rank ({pp} x {vpp} = {stages}; set by"
                    f" {VPP_FLAG} or {VPP_LAYERS_FLAG})"
                )
            problems.append(
                f"--num-layers ({num_layers}) must be divisible by {split} so every stage gets"
                f" the same layers: try --num-layers {_layer_hint(num_layers, stages)}"
            )
    return problems


def build_table(name: str, pp: int, vpp: int, m: int) -> Table:
    """The table of schedule ``name``; ``ValueError`` (all problems, '; '-joined) if it cannot."""
    problems = table_problems(name, pp, vpp, m)
    if problems:
        raise ValueError("; ".join(problems))
    return SCHEDULE_TABLES[name].build(pp, vpp, m)
