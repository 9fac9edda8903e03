"""The process topology: which rank this is, and its groups. One object, passed explicitly.

Until multi-process training lands, a run is one process: world size 1, rank 0, every
parallel size 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Topology:
    world_size: int = 1
    rank: int = 0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        model_parallel = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.expert_model_parallel_size
        )
        return self.world_size // model_parallel

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (
            f"world {self.world_size} = dp {self.data_parallel_size} x pp "
            f"{self.pipeline_model_parallel_size} x cp {self.context_parallel_size} x ep "
            f"{self.expert_model_parallel_size} x tp {self.tensor_model_parallel_size}"
        )
