"""Whether a parallel layout can run: the world size, the model's parallel plan, the schedule
and the features built so far. Pure Python, run before any process group exists; every problem
is returned, one line each."""

from __future__ import annotations

from typing import Any

from mega.parallel.context.validate import context_parallel_problems
from mega.parallel.fp8.checks import fp8_run_problems
from mega.parallel.pipeline.setup import pipeline_setup
from mega.parallel.plan import no_plan_message, plan_features
from mega.parallel.tensor.validate import sequence_parallel_problems
from mega.parallel.topology import layout_problems as world_problems


def parallel_problems(config: Any, plugins: Any) -> list[str]:
    """Every reason the run's parallel layout cannot run."""
    p = config.parallel
    errors = world_problems(config.world_size, p.sizes())
    if p.expert_tensor_parallel_size != 1:
        errors.append(
            f"--expert-tensor-parallel-size {p.expert_tensor_parallel_size}: experts are not split"
            " over tensor-parallel ranks in mega (only 1 is supported)"
        )
    tp = p.tensor_model_parallel_size
    features = plan_features(p)
    plan = None
    if config.model_name in plugins.models:
        spec = plugins.models.get(config.model_name)
        plan = spec.parallel_plan(config.model) if spec.parallel_plan else None
        if features and plan is None:
            errors.append(no_plan_message(f"model '{config.model_name}'", features))
        elif features:
            errors += plan.problems(tp)
    errors += expert_problems(config, plan, plugins)
    errors += context_parallel_problems(config, plan, plugins)
    errors += fp8_run_problems(config, plan)
    errors += pipeline_setup(config, plugins)[1]
    if p.sequence_parallel:
        errors += sequence_parallel_problems(config.training.seq_length, tp)
    ckpt = config.checkpoint
    backends = plugins.checkpoint_backends
    if ckpt.ckpt_format in backends:
        sharded = backends.get(ckpt.ckpt_format).sharded
        if config.world_size > 1 and ckpt.save and not sharded:
            errors.append(
                f"--ckpt-format {ckpt.ckpt_format} writes one process's state; with"
                f" {config.world_size} processes use --ckpt-format zarr"
            )
        if ckpt.async_save and not sharded:
            errors.append(
                f"--async-save needs a sharded --ckpt-format (zarr), not {ckpt.ckpt_format}"
            )
    return errors


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
