"""Turn a single-device model into this rank's part of the parallel model. The order:
tensor/sequence -> expert -> context -> pipeline split -> activation recompute (per chunk) -> data
parallel / distributed optimizer (in the engine, once the model sits on its device in its dtype).

Tensor parallelism goes first, on the whole model, so that every plan path exists when it is
applied; the split then keeps modules that are already sharded. (DESIGN.md listed the split
first; the result is the same and this way neither step needs to know about the other.)
Recompute comes after the split because its groups of layers are counted within each chunk, as
in Megatron.

The model arrives fully built and initialised (fp32, CPU): the same global weights for every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mega.errors import MegaUsageError
from mega.parallel.context.apply import apply_context_parallel
from mega.parallel.expert.apply import apply_expert_parallel
from mega.parallel.pipeline.layout import PipelineLayout
from mega.parallel.pipeline.split import split_for_pipeline
from mega.parallel.plan import ParallelPlan, no_plan_message, plan_features
from mega.parallel.recompute import apply_recompute
from mega.parallel.topology import Topology


def parallelize(
    model: torch.nn.Module,
    plan: ParallelPlan | None,
    parallel: Any,
    topology: Topology,
    layout: PipelineLayout | None = None,
    build_dispatcher: Callable[[Any], Any] | None = None,
    cp_comm_type: Any = None,
) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """This rank's model (global parameter names) and its pipeline chunks (``[model]`` without
    pipelining). Tensor/sequence parallelism, expert parallelism (``build_dispatcher``: the
    registered MoE dispatcher's ``build``), context parallelism (``cp_comm_type``: the
    registered ``CPCommTypeSpec``) and recompute are applied in place."""
    features = plan_features(parallel)
    if layout is not None and layout.pp * layout.vpp > 1:
        features.append("pipeline stages")
    if features and plan is None:  # resolve_config refuses this first; a library caller may not
        raise MegaUsageError(no_plan_message("this model", features))
    if topology.tensor_model_parallel_size > 1:
        from mega.parallel.tensor.apply import apply_tensor_parallel

        apply_tensor_parallel(
            model,
            plan,
            topology,
            sequence_parallel=parallel.sequence_parallel,
            comm_overlap=parallel.tp_comm_overlap is not False,  # on unless turned off
        )
    apply_expert_parallel(model, plan, topology, parallel.sequence_parallel, build_dispatcher)
    if topology.context_parallel_size > 1:
        spec = cp_comm_type
        apply_context_parallel(model, plan, topology, spec.build, spec.name)
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
