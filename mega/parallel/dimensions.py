"""The run's parallel dimensions (``mega.parallel.dimension.ParallelDimension``): the built-in
ones in the order ``parallelize`` applies them, then a plugin's. Torch-free: the checks before
launch read it too."""

from __future__ import annotations

from typing import Any

from mega.parallel.context.dimension import ContextDimension
from mega.parallel.dimension import ParallelDimension
from mega.parallel.expert.dimension import ExpertDimension
from mega.parallel.tensor.dimension import TensorDimension
from mega.parallel.topology import JOINS

# The built-in dimensions, in the order they are applied: tensor/sequence first (on the whole
# model, every plan path present), then expert (its dispatcher under sequence parallelism),
# then context (it wraps the core attention the others left in place).
BUILT_IN: tuple[ParallelDimension, ...] = (
    TensorDimension(
        name="tp",
        joins=JOINS["tp"],
        description="tensor (and sequence) parallelism (--tensor-model-parallel-size)",
    ),
    ExpertDimension(
        name="ep",
        joins=JOINS["ep"],
        description="expert parallelism (--expert-model-parallel-size)",
    ),
    ContextDimension(
        name="cp", joins=JOINS["cp"], description="context parallelism (--context-parallel-size)"
    ),
)


def run_dimensions(topology: Any, choices: Any) -> list[ParallelDimension]:
    """The run's dimensions in order: the built-in ones, then each plugin dimension the
    topology has a coordinate for (``--extra-parallel-size``), in that flag's order."""
    registered = choices(ParallelDimension.choice_kind) if topology.extra_sizes else None
    return [*BUILT_IN, *(registered.get(name) for name in topology.extra_sizes)]


def extra_joins(parallel: Any, choices: Any) -> dict[str, tuple[str, ...]]:
    """The derived groups each plugin dimension of the run (``--extra-parallel-size``) joins,
    for ``build_topology``."""
    registered = choices(ParallelDimension.choice_kind) if parallel.extra_sizes() else {}
    return {name: registered.get(name).joins for name in parallel.extra_sizes()}
