"""Cut a model's experts over the expert-parallel group, from its ParallelPlan.

Every module matching ``plan.moe_layers`` that has ``experts`` is a MoE layer with this shape:
``experts`` holds the stacked expert weights (dim 0 is the expert, ``experts.first`` the global
id of its first one), ``router.token_group`` is the group over which the router sums its
load-balancing counts, and ``dispatcher`` moves tokens to the experts' ranks.

With ``E`` experts over ``ep`` ranks, rank ``r`` keeps experts ``r*E/ep .. (r+1)*E/ep - 1``:
each weight is sliced along dim 0 and marked ``expert_parallel`` (gradients reduced over the
expert-data-parallel group) with its ``ShardSpec`` over group "ep" (checkpoints store the
global tensor), and the layer gets the registered dispatcher over the "ep" group. Experts are
never split over tensor parallelism (Megatron's ``--expert-tensor-parallel-size 1``): under
sequence parallelism every TP rank routes its own tokens and the experts' gradients are partial
sums over TP, as for the norms.

Call it after tensor parallelism (which marks the sequence-parallel parameters) and before the
pipeline split, on the full model as built (every rank then holds the same global weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from mega.parallel.plan import ParallelPlan
from mega.parallel.shard import ShardSpec
from mega.parallel.tensor.apply import matching_paths
from mega.parallel.topology import Topology


def moe_layers(model: nn.Module, plan: ParallelPlan | None) -> list[nn.Module]:
    """The model's MoE layers (modules of ``plan.moe_layers`` that have ``experts``)."""
    if plan is None or not plan.moe_layers:
        return []
    modules = [model.get_submodule(path) for path in matching_paths(model, plan.moe_layers)]
    return [m for m in modules if hasattr(m, "experts")]


def apply_expert_parallel(
    model: nn.Module,
    plan: ParallelPlan | None,
    topology: Topology,
    sequence_parallel: bool,
    build_dispatcher: Callable[[Any], Any] | None,
) -> None:
    """Keep this rank's experts and give every MoE layer its dispatcher (module docstring)."""
    ep = topology.expert_model_parallel_size
    rank = topology.group_rank("ep")
    for layer in moe_layers(model, plan):
        # the ranks holding the micro-batch's other tokens: its sequence's other positions
        # (context parallel), or its other token blocks (sequence parallel), or both
        split_tp = sequence_parallel and topology.tensor_model_parallel_size > 1
        layer.router.token_group = topology.group("tpcp" if split_tp else "cp")
        if split_tp:
            layer.router.token_block = (
                topology.group_rank("tp"),
                topology.tensor_model_parallel_size,
            )
        if ep == 1:
            continue
        experts = layer.experts
        total = experts.count
        if total % ep:
            raise ValueError(
                f"--num-experts ({total}) must be divisible by --expert-model-parallel-size ({ep})"
            )
        per_rank = total // ep
        first = rank * per_rank
        for param in experts.parameters():
            spec = ShardSpec(tuple(param.shape), 0, 1, rank, ep, group="ep")
            param.data = param.data[first : first + per_rank].clone()
            param.shard = spec
            param.expert_parallel = True
        experts.first = first
        if build_dispatcher is None:
            raise ValueError("expert parallelism needs a token dispatcher")
        layer.dispatcher = build_dispatcher(topology.group("ep"))
        # what the dispatcher needs of the compiler where its layer is compiled (--compile)
        if getattr(layer.dispatcher, "compile_options", None):
            layer.compile_options = layer.dispatcher.compile_options
