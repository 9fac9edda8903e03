"""One parallel dimension's contract: what a run needs from a way of splitting its work over
ranks, so that the training code (build, step, engine, executor) names no dimension.

A dimension is named by its coordinate in the topology ("tp", "cp", "ep", or a plugin's) and
may override any of the methods below; the defaults do nothing. The built-in ones
(``mega.parallel.tensor.dimension``, ``expert.dimension``, ``context.dimension``) are applied
in the order ``mega.parallel.dimensions.BUILT_IN`` writes down (the order stays code, as in
torchtitan's ``parallelize``); a plugin's, registered through ``register_parallel_choices``
and sized by ``--extra-parallel-size NAME=SIZE``, after them, in the order of that flag.

A plugin's dimension gets a coordinate of its own between the expert and the data coordinates
(``mega.parallel.topology.coordinates``) and a process group of that name
(``topology.group(name)``); its ranks hold the same data (the engine's batch arithmetic,
micro-batch x data-parallel size, is unchanged), so it may join the derived groups "mp" (the
ranks that hold one copy of the model between them: they sum a gradient norm) and "tpcp", not
the data-parallel ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover - a dimension's registration must not import torch
    import torch

# the executor's loss function: (the last stage's output, the micro-batch) -> fp32 loss parts
LossFn = Callable[[Any, dict[str, Any]], Any]
# a micro-batch's host arrays -> the arrays that go to the device
Prepare = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class ParallelDimension:
    """A parallel dimension. ``choices`` below is the run's choice registries by kind
    (``Plugins.choices``: ``choices("cp comm type").get(name)``); ``plugins`` the run's plugin
    manager (for checks that read other registries, such as the models')."""

    choice_kind: ClassVar[str] = "parallel dimension"  # its registry (register_parallel_choices)
    name: str  # its topology coordinate and process group
    # the derived groups whose ranks vary this coordinate too (``mega.parallel.topology.JOINS``
    # has the built-in ones'); a plugin's may name "mp" and "tpcp"
    joins: tuple[str, ...] = ()
    description: str = ""

    def problems(self, config: Any, plan: Any, plugins: Any) -> list[str]:
        """Why the run's config cannot use this dimension, one line each (before launch)."""
        return []

    def apply(
        self, model: torch.nn.Module, plan: Any, parallel: Any, topology: Any, choices: Any
    ) -> None:
        """Make the single-device ``model`` this rank's part along this dimension, in place
        (before the pipeline split: every plan path still exists)."""

    def prepare_microbatch(self, topology: Any) -> Prepare | None:
        """A host-side step of each micro-batch's arrays (context parallelism: the cut to this
        rank's positions), or None."""
        return None

    def share_loss(self, loss: LossFn, topology: Any) -> LossFn:
        """The loss function, wrapped where this rank's loss is a share of the micro-batch's."""
        return loss

    def local_positions(self, positions: int, parallel: Any, topology: Any) -> int:
        """How many of a micro-batch's ``positions`` one rank holds between layers (what
        crosses between pipeline stages)."""
        return positions

    def seed_offset(self, topology: Any) -> int:
        """Added to the run's seed of runtime randomness (dropout) on this rank: non-zero where
        this dimension's ranks hold other positions of the same samples (context parallelism),
        whose masks must differ."""
        return 0

    def step_scale(self, scale: float, device: torch.device) -> None:
        """Told, before each step's forwards, the factor each micro-batch's loss gradient gets
        (1 / micro-batches, times the loss scale): for losses this dimension's layers add
        inside the forward (MoE's auxiliary losses)."""

    def metrics(self, model: torch.nn.Module, topology: Any) -> dict[str, Any]:
        """Extra values for the iteration line since the last one (MoE: router load balance,
        dropped tokens); collective over every rank alike, or empty."""
        return {}


def chain(steps: list[Prepare | None]) -> Prepare | None:
    """The micro-batch steps that are not None, applied in order; None when there are none."""
    present = [step for step in steps if step is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def prepare(arrays: dict[str, Any]) -> dict[str, Any]:
        for step in present:
            arrays = step(arrays)
        return arrays

    return prepare
