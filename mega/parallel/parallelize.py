"""Turn a single-device model into this rank's part of the parallel model. The order:
tensor/sequence -> expert -> context -> a plugin's dimensions (each a ``ParallelDimension``) ->
pipeline split -> activation recompute (per chunk) -> data parallel / distributed optimizer (in
the engine, once the model sits on its device in its dtype).

Tensor parallelism goes first, on the whole model, so that every plan path exists when it is
applied; the split then keeps modules that are already sharded. (DESIGN.md listed the split
first; the result is the same and this way neither step needs to know about the other.)
Recompute comes after the split because its groups of layers are counted within each chunk, as
in Megatron.

The model arrives fully built and initialised (fp32, CPU): the same global weights for every layout.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.errors import MegaUsageError
from mega.parallel.dimensions import BUILT_IN, extra_joins, run_dimensions
from mega.parallel.pipeline.layout import PipelineLayout
from mega.parallel.pipeline.split import split_for_pipeline
from mega.parallel.plan import ParallelPlan, no_plan_message, plan_features
from mega.parallel.recompute import apply_recompute
from mega.parallel.topology import Topology

__all__ = ["BUILT_IN", "extra_joins", "parallelize", "run_dimensions"]  # the dimensions' list too


def parallelize(
    model: torch.nn.Module,
    plan: ParallelPlan | None,
    parallel: Any,
    topology: Topology,
    layout: PipelineLayout | None = None,
    choices: Any = None,
) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """This rank's model (global parameter names) and its pipeline chunks (``[model]`` without
    pipelining). Every dimension of the run (``run_dimensions``) is applied in place, then the
    pipeline split and recompute. ``choices``: the run's choice registries by kind
    (``Plugins.choices``), where the dimensions find the MoE dispatcher and CP comm type."""
    features = plan_features(parallel)
    if layout is not None and layout.pp * layout.vpp > 1:
        features.append("pipeline stages")
    if features and plan is None:  # resolve_config refuses this first; a library caller may not
        raise MegaUsageError(no_plan_message("this model", features))
    for dimension in run_dimensions(topology, choices):
        dimension.apply(model, plan, parallel, topology, choices)
    chunks = [model]
    if layout is not None:
        model, chunks = split_for_pipeline(model, plan, layout, topology.pp_rank)
    if parallel.recompute_granularity:
        for chunk in chunks:
            apply_recompute(
                chunk,
                plan,
                parallel.recompute_granularity,
                parallel.recompute_method,
                parallel.recompute_num_layers,
            )
    return model, chunks
