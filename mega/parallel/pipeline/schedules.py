"""Pipeline schedules in the plugin registry, what they need, and the checks before a launch.

A schedule is a ``PipelineScheduleSpec`` registered with the ``register_parallel_choices`` hook
(``mega.plugins.parallel.schedules`` registers the built-in ones; a third-party plugin adds one
the same way). ``schedule_spec`` finds one by name; the functions
below take the spec. Everything here is pure Python.
"""

from __future__ import annotations

from typing import Any

from mega.errors import MegaUsageError, unknown_name_message
from mega.parallel.pipeline.actions import Table
from mega.parallel.pipeline.layout import layout_problems
from mega.parallel.pipeline.spec import PipelineScheduleSpec

PP_FLAG = "--pipeline-model-parallel-size"
VPP_FLAG = "--virtual-pipeline-model-parallel-size"
VPP_LAYERS_FLAG = "--num-layers-per-virtual-pipeline-stage"


# a schedule needs a micro-batch (mega.core.config.validate recognises the 0 case)
NO_MICROBATCHES = "the number of micro-batches must be at least 1 (got {})"


def pipeline_schedules(plugins: Any) -> dict[str, PipelineScheduleSpec]:
    """The schedules that split a model over pipeline ranks (every one but those with
    ``max_pp == 1``, such as ``no-pipelining``), by name."""
    return {
        name: entry.spec
        for name, entry in plugins.parallel.items()
        if entry.spec.max_pp is None or entry.spec.max_pp > 1
    }


def schedule_spec(plugins: Any, name: str) -> PipelineScheduleSpec:
    """The pipeline schedule called ``name`` in ``plugins.parallel`` (``plugins`` from
    ``mega.core.plugins.manager.make_plugins()``); ``MegaUsageError`` naming the pipeline schedules, with
    the closest one, if there is none or ``name`` is another kind of parallel spec."""
    plugins.parallel.check_name(name)  # a name two plugins registered: use neither
    schedules = pipeline_schedules(plugins)
    if name in schedules:
        return schedules[name]
    if name in plugins.parallel:
        known = ", ".join(sorted(schedules)) or "none"
        raise MegaUsageError(f"'{name}' is not a pipeline schedule (pipeline schedules: {known})")
    raise MegaUsageError(unknown_name_message("pipeline schedule", name, schedules))


def table_problems(
    spec: PipelineScheduleSpec, pp: int, vpp: int, m: int, num_layers: int | None = None
) -> list[str]:
    """Why schedule ``spec`` cannot run with these sizes, one actionable line each (empty when it
    can)."""
    name = spec.name
    problems = []
    if spec.max_pp is not None and pp > spec.max_pp:
        problems.append(f"{PP_FLAG} must be at most {spec.max_pp} for '{name}' (got {pp})")
    if pp < spec.min_pp:
        problems.append(f"{PP_FLAG} must be at least {spec.min_pp} for '{name}' (got {pp})")
    if vpp < 1:
        problems.append(f"{VPP_FLAG} must be at least 1 (got {vpp})")
    elif vpp > 1 and not spec.interleaved:
        problems.append(
            f"'{name}' runs one model chunk per rank, but {VPP_FLAG} is {vpp}: use"
            f" --parallel interleaved, or drop {VPP_FLAG}/{VPP_LAYERS_FLAG}"
        )
    if m < 1:
        problems.append(NO_MICROBATCHES.format(m))
    if problems:
        return problems
    needed = spec.min_microbatches(pp, vpp)
    if m < needed:
        problems.append(
            f"'{name}' with {PP_FLAG} {pp} needs at least {needed} micro-batches per global batch,"
            f" got {m} (= --global-batch-size / (--micro-batch-size x data-parallel size))"
        )
    if num_layers is not None:
        problems += layout_problems(num_layers, pp, vpp)
    return problems


def build_table(spec: PipelineScheduleSpec, pp: int, vpp: int, m: int) -> Table:
    """The table of schedule ``spec``; ``ValueError`` (all problems, '; '-joined) if it cannot."""
    problems = table_problems(spec, pp, vpp, m)
    if problems:
        raise ValueError("; ".join(problems))
    return spec.table(pp, vpp, m)
