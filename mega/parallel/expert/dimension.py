"""Expert parallelism as a ``ParallelDimension``: each MoE layer's experts split over the
``ep`` group, its tokens reaching them through the registered dispatcher
(``--moe-token-dispatcher-type``). Applied at every size: an MoE layer needs its dispatcher on
one rank too."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from mega.parallel.dimension import ParallelDimension
from mega.parallel.expert.validate import expert_problems


@dataclass(frozen=True, kw_only=True)
class ExpertDimension(ParallelDimension):
    def problems(self, config: Any, plan: Any, plugins: Any) -> list[str]:
        return expert_problems(config, plan, plugins)

    def apply(self, model: Any, plan: Any, parallel: Any, topology: Any, choices: Any) -> None:
        from mega.parallel.expert.apply import apply_expert_parallel

        dispatcher = None
        if plan is not None and plan.moe_layers:
            dispatcher = choices("moe dispatcher").get(plan.moe_dispatcher).build
            if plan.moe_overlap_comm:  # validated: a dispatcher that overlaps (flex)
                dispatcher = functools.partial(_overlapping, dispatcher)
        apply_expert_parallel(model, plan, topology, parallel.sequence_parallel, dispatcher)

    def step_scale(self, scale: float, device: Any) -> None:
        from mega.parallel.expert.aux_loss import set_backward_scale

        set_backward_scale(scale, device)

    def metrics(self, model: Any, topology: Any) -> dict[str, Any]:
        from mega.parallel.expert.stats import router_metrics

        return router_metrics(model, topology)  # MoE: load balancing, drops


def _overlapping(build: Any, group: Any) -> Any:
    """The dispatcher ``build`` makes, with its trips overlapped
    (``--overlap-moe-expert-parallel-comm``)."""
    dispatcher = build(group)
    dispatcher.overlap_trips()
    return dispatcher
