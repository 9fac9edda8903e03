"""Context parallelism as a ``ParallelDimension``: each sequence split over the ``cp`` group
(zigzag chunks, ``mega.parallel.context.layout``), attention reaching the other ranks'
positions through the registered communication type (``--cp-comm-type``), each rank's loss a
share of the micro-batch's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega.parallel.context.validate import context_parallel_problems
from mega.parallel.dimension import LossFn, ParallelDimension, Prepare


@dataclass(frozen=True, kw_only=True)
class ContextDimension(ParallelDimension):
    def problems(self, config: Any, plan: Any, plugins: Any) -> list[str]:
        return context_parallel_problems(config, plan, plugins)

    def apply(self, model: Any, plan: Any, parallel: Any, topology: Any, choices: Any) -> None:
        if topology.context_parallel_size == 1:
            return
        from mega.parallel.context.apply import apply_context_parallel

        spec = choices("cp comm type").get(parallel.cp_comm_type)
        apply_context_parallel(model, plan, topology, spec.build, spec.name)

    def prepare_microbatch(self, topology: Any) -> Prepare | None:
        cp = topology.context_parallel_size
        if cp == 1:
            return None
        from mega.parallel.context.layout import split_microbatch

        rank = topology.group_rank("cp")
        return lambda arrays: split_microbatch(arrays, rank, cp)

    def share_loss(self, loss: LossFn, topology: Any) -> LossFn:
        group = topology.group("cp")
        if group is None:
            return loss
        from mega.parallel.context.apply import context_parallel_loss

        def share(output: Any, microbatch: dict[str, Any]) -> Any:
            return context_parallel_loss(
                loss(output, microbatch), microbatch["cp_loss_weight"], group
            )

        return share

    def seed_offset(self, topology: Any) -> int:
        return 7919 * topology.group_rank("cp")

    def local_positions(self, positions: int, parallel: Any, topology: Any) -> int:
        return positions // topology.context_parallel_size
