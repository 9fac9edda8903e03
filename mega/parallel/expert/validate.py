"""What the run's expert layout and MoE dispatcher need: pure Python, run before any process
group exists (``ExpertDimension.problems``)."""

from __future__ import annotations

from typing import Any


def expert_problems(config: Any, plan: Any, plugins: Any) -> list[str]:
    """What the run's expert layout and MoE dispatcher need."""
    p = config.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    moe = plan is not None and bool(plan.moe_layers)
    errors = []
    if ep > 1 and not moe:
        errors.append(
            f"--expert-model-parallel-size {ep}: model '{config.model_name}' has no experts"
            " (give --num-experts)"
        )
    if not moe:
        return errors
    experts = getattr(config.model, "num_experts", None)
    if experts and experts % ep:
        errors.append(
            f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep})"
        )
    if tp > 1 and not p.sequence_parallel:
        errors.append(
            f"--tensor-model-parallel-size {tp} with experts needs --sequence-parallel"
            " (as in Megatron: each rank routes its own slice of the sequence)"
        )
    dispatchers = plugins.moe_dispatchers
    if plan.moe_dispatcher not in dispatchers:
        errors.append(
            f"--moe-token-dispatcher-type {plan.moe_dispatcher!r}: no such dispatcher"
            f" (have: {', '.join(dispatchers.names())})"
        )
    elif (
        getattr(config.model, "moe_expert_capacity_factor", None) is not None
        and not dispatchers.peek(plan.moe_dispatcher).drops_tokens
    ):
        errors.append(
            f"--moe-expert-capacity-factor: the {plan.moe_dispatcher} dispatcher cannot drop tokens"
        )
    return errors
