"""Tensor (and sequence) parallelism as a ``ParallelDimension``: the plan's linears and
embeddings split over the ``tp`` group; with ``--sequence-parallel`` the positions between
them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega.parallel.dimension import ParallelDimension
from mega.parallel.tensor.validate import sequence_parallel_problems


@dataclass(frozen=True, kw_only=True)
class TensorDimension(ParallelDimension):
    def problems(self, config: Any, plan: Any, plugins: Any) -> list[str]:
        p = config.parallel
        if not p.sequence_parallel:
            return []
        return sequence_parallel_problems(config.training.seq_length, p.tensor_model_parallel_size)

    def apply(self, model: Any, plan: Any, parallel: Any, topology: Any, choices: Any) -> None:
        if topology.tensor_model_parallel_size == 1:
            return
        from mega.parallel.tensor.apply import apply_tensor_parallel

        apply_tensor_parallel(
            model,
            plan,
            topology,
            sequence_parallel=parallel.sequence_parallel,
            comm_overlap=parallel.tp_comm_overlap is not False,  # on unless turned off
        )

    def local_positions(self, positions: int, parallel: Any, topology: Any) -> int:
        if not parallel.sequence_parallel:
            return positions
        return positions // topology.tensor_model_parallel_size
