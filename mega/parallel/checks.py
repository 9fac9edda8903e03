"""Whether a parallel layout can run: the world size, the model's parallel plan, the schedule
and the features built so far. Pure Python, run before any process group exists; every problem
is returned, one line each."""

from __future__ import annotations

from typing import Any

from mega._deprecated import moved
from mega.parallel.attention_spec import BUILT_IN_NAMES, AttentionKernelSpec, blocks_problem
from mega.parallel.dimension import ParallelDimension
from mega.parallel.dimensions import BUILT_IN
from mega.parallel.fp8.checks import fp8_run_problems
from mega.parallel.pipeline.setup import pipeline_setup
from mega.parallel.plan import no_plan_message, plan_features
from mega.parallel.topology import layout_problems as world_problems

# moved to the expert-parallel package with the dimension that runs it (2026-11-29)
__getattr__ = moved(
    __name__, "mega.parallel.expert.validate", ["expert_problems"], since="2026-11-29"
)


def parallel_problems(config: Any, plugins: Any) -> list[str]:
    """Every reason the run's parallel layout cannot run."""
    p = config.parallel
    errors: list[str] = []
    extra = extra_dimensions(p.extra_sizes(), plugins, errors)
    sizes = {**p.sizes(), **{d.name: p.extra_sizes()[d.name] for d in extra}}
    errors += world_problems(config.world_size, sizes)
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
    for dimension in [*BUILT_IN, *extra]:
        errors += dimension.problems(config, plan, plugins)
    errors += attention_kernel_problems(config, plugins)
    errors += fp8_run_problems(config, plan)
    errors += pipeline_setup(config, plugins)[1]
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


def extra_dimensions(
    sizes: dict[str, int], plugins: Any, errors: list[str]
) -> list[ParallelDimension]:
    """The registered dimensions that ``--extra-parallel-size`` names; an unknown name goes to
    ``errors``, naming the registered ones."""
    registered = plugins.choices(ParallelDimension.choice_kind)
    unknown = [name for name in sizes if name not in registered]
    if unknown:
        have = ", ".join(registered.names()) or "none registered"
        errors.append(
            f"--extra-parallel-size: no parallel dimension {', '.join(map(repr, unknown))}"
            f" (have: {have})"
        )
    return [registered.get(name) for name in sizes if name in registered]


def attention_kernel_problems(config: Any, plugins: Any) -> list[str]:
    """``--attention-backend`` names a built-in attention kernel or a registered one (a model
    without the flag has nothing to check)."""
    name = getattr(config.model, "attention_backend", None)
    registered = plugins.choices(AttentionKernelSpec.choice_kind)
    problem = blocks_problem(registered.peek(name)) if name in registered else None
    if problem:
        return [f"--attention-backend {name}: {problem} (plugin '{registered.provider(name)}')"]
    if name is None or name in BUILT_IN_NAMES or name in registered:
        return []
    have = [*BUILT_IN_NAMES, *registered.names()]
    return [f"--attention-backend {name!r}: no such attention kernel (have: {', '.join(have)})"]
