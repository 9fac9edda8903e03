"""The pipeline schedule spec (``--parallel NAME``): defined here, beside the machinery that
runs its tables, and registered through the ``register_parallel_choices`` hook like every parallel choice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class PipelineScheduleSpec:
    """A schedule, selected by ``--parallel NAME``: a table of actions, not an engine. Every run
    goes through one: ``no-pipelining`` is the one-stage table ``F0 B0 F1 B1 ...``.

    ``table(pp, vpp, m)`` returns, for every pipeline rank ``0..pp-1``, its ordered list of
    actions (``mega.parallel.pipeline.actions``: ``Forward``/``Backward`` of a micro-batch
    on a local model chunk, ``Send``/``Recv`` of activations and gradients). One executor runs any
    table; ``mega schedule`` simulates it. Pure Python: building a table must not import torch.

    ``min_microbatches(pp, vpp)`` is the fewest micro-batches per global batch the table runs
    with; ``analytic_bubble(pp, vpp, m)`` the closed-form idle fraction with unit forward and
    backward costs, or None. ``interleaved``: the table runs ``vpp > 1`` chunks per rank.
    ``max_pp``: the most pipeline ranks the table is for (1 for ``no-pipelining``), or None.
    """

    # the registry it joins through ``register_parallel_choices`` (the ``--parallel`` choice)
    choice_kind: ClassVar[str] = "parallel"
    name: str
    table: Callable[[int, int, int], Any]
    description: str = ""
    interleaved: bool = False
    min_pp: int = 1
    max_pp: int | None = None
    min_microbatches: Callable[[int, int], int] = field(default=lambda pp, vpp: 1)
    analytic_bubble: Callable[[int, int, int], float | None] = field(
        default=lambda pp, vpp, m: None
    )
