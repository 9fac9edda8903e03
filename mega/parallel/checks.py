"""Whether a parallel layout can run: the world size, the model's parallel plan, the schedule
and the features built so far. Pure Python, run before any process group exists; every problem
is returned, one line each."""

from __future__ import annotations

from typing import Any

from mega.parallel.pipeline.setup import pipeline_setup
from mega.parallel.plan import no_plan_message, plan_features
from mega.parallel.tensor.validate import sequence_parallel_problems
from mega.parallel.topology import layout_problems as world_problems


def parallel_problems(config: Any, plugins: Any) -> list[str]:
    """Every reason the run's parallel layout cannot run."""
    p = config.parallel
    errors = world_problems(config.world_size, p.sizes())
    for flag, size in (
        ("--context-parallel-size", p.context_parallel_size),
        ("--expert-model-parallel-size", p.expert_model_parallel_size),
    ):
        if size > 1:
            errors.append(f"{flag} {size}: only 1 is supported so far")
    tp = p.tensor_model_parallel_size
    if tp > 1 and config.training.compile:
        # Measured on 4 H200 (torch 2.11): compiled layers with the tensor-parallel collectives
        # inside trained differently from eager from step 3 on, and 30% slower.
        errors.append(
            f"--compile with --tensor-model-parallel-size {tp}: not supported yet (compiled "
            "layers mishandle the tensor-parallel collectives); leave --compile off"
        )
    features = plan_features(p)
    if features and config.model_name in plugins.models:
        spec = plugins.models.get(config.model_name)
        if spec.parallel_plan is None:
            errors.append(no_plan_message(f"model '{config.model_name}'", features))
        else:
            errors += spec.parallel_plan(config.model).problems(tp)
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
