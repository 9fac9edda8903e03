"""Turn a single-device model into this rank's part of the parallel model, in DESIGN.md's fixed order:
pipeline split -> tensor/sequence -> context -> expert -> activation recompute -> compile ->
data parallel / distributed optimizer.

The model arrives fully built and initialised (fp32, CPU): the same global weights for every layout.
Each step keeps this rank's share; the last one (buffers, optimizer) happens in the engine once the
model sits on its device in its dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.core.errors import MegaUsageError
from mega.core.parallel_plan import ParallelPlan
from mega.core.recompute import apply_recompute
from mega.core.topology import Topology


def parallelize(
    model: torch.nn.Module, plan: ParallelPlan | None, parallel: Any, topology: Topology
) -> torch.nn.Module:
    """Apply tensor/sequence parallelism and recomputation to ``model`` in place."""
    needs_plan = topology.tensor_model_parallel_size > 1 or parallel.recompute_granularity
    if needs_plan and plan is None:
        raise MegaUsageError(
            "this model's plugin provides no parallel plan, so it supports neither "
            "--tensor-model-parallel-size > 1 nor --recompute-granularity"
        )
    if topology.tensor_model_parallel_size > 1:
        from mega.plugins.parallel.tensor.apply import apply_tensor_parallel

        apply_tensor_parallel(model, plan, topology, sequence_parallel=parallel.sequence_parallel)
    if parallel.recompute_granularity:
        apply_recompute(
            model,
            plan,
            parallel.recompute_granularity,
            parallel.recompute_method,
            parallel.recompute_num_layers,
        )
    return model
