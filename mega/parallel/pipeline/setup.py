"""The run's schedule: which table, how many virtual stages, which layers where.

Every run has one, ``no-pipelining`` (a one-stage table) included, so the engine has one step
path. Read from the config by the checks before launch (every problem listed at once) and by the
engine when it builds the model. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega.parallel.pipeline.layout import (
    FIRST,
    LAST,
    LAYOUT,
    PP,
    VPP,
    VPP_LAYERS,
    PipelineLayout,
    explicit_layout_problems,
    layout_problems,
    parse_layout,
    pipeline_layout,
    virtual_stages_per_rank,
)
from mega.parallel.pipeline.schedules import pipeline_schedules, table_problems
from mega.parallel.pipeline.spec import PipelineScheduleSpec
from mega.parallel.plan import no_plan_message


@dataclass(frozen=True)
class PipelineSetup:
    spec: PipelineScheduleSpec
    layout: PipelineLayout


def default_schedule(parallel: Any) -> str:
    """Megatron's choice when ``--parallel`` is not given: no pipelining on one stage, interleaved
    1F1B when virtual stages are asked for, 1F1B otherwise."""
    if parallel.pipeline_model_parallel_size == 1:
        return "no-pipelining"
    virtual = parallel.virtual_pipeline_model_parallel_size or 1
    if parallel.pipeline_model_parallel_layout:
        counts, _ = parse_layout(parallel.pipeline_model_parallel_layout)
        virtual = max(virtual, len(counts) // parallel.pipeline_model_parallel_size)
    if virtual > 1 or parallel.num_layers_per_virtual_pipeline_stage is not None:
        return "interleaved"
    return "1f1b"


def pipeline_setup(config: Any, plugins: Any) -> tuple[PipelineSetup | None, list[str]]:
    """The run's schedule and layout, or None and every reason it cannot run."""
    p = config.parallel
    if p.parallel not in plugins.parallel:
        return None, []  # reported with the other unknown plugin names
    spec = plugins.parallel.get(p.parallel)
    pp = p.pipeline_model_parallel_size
    virtual_flags = (
        p.virtual_pipeline_model_parallel_size,
        p.num_layers_per_virtual_pipeline_stage,
    )
    if spec.max_pp == 1:  # no-pipelining and its kind: the whole model on every rank
        problems = []
        if pp > 1:
            problems.append(
                f"--parallel {p.parallel} runs the whole model on every rank; with {PP} {pp}"
                f" choose a pipeline schedule: {', '.join(pipeline_schedules(plugins))}"
            )
        if any(v is not None for v in virtual_flags):
            problems.append(f"{VPP}/{VPP_LAYERS} need --parallel interleaved")
        problems += table_problems(spec, 1, 1, config.num_microbatches) if not problems else []
        if problems:
            return None, problems
    model_spec = plugins.models.get(config.model_name)
    plan = model_spec.parallel_plan(config.model) if model_spec.parallel_plan else None
    if spec.max_pp == 1 and (plan is None or not plan.pipeline_first):
        # a model without pipeline stages runs as one chunk; its layers are not counted
        return PipelineSetup(spec, PipelineLayout(pp=1, vpp=1, stages=(range(0),))), []
    if plan is None:
        return None, [no_plan_message(f"model '{config.model_name}'", [f"{PP} {pp}"])]
    if not plan.pipeline_first:  # no first-stage modules named: the split has no map
        return None, [
            f"{PP} {pp}: model '{config.model_name}' cannot be split into pipeline stages"
            f" (its parallel plan names none; --parallel {spec.name})"
        ]
    vpp, problems = virtual_stages_per_rank(plan.num_layers, pp, *virtual_flags)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if p.num_layers_per_virtual_pipeline_stage is not None and (first, last) != (None, None):
        problems.append(f"{FIRST}/{LAST} take {VPP}, not {VPP_LAYERS}")
    counts = None
    if p.pipeline_model_parallel_layout:
        if (first, last) != (None, None) or p.num_layers_per_virtual_pipeline_stage is not None:
            problems.append(f"{LAYOUT} replaces {FIRST}/{LAST} and {VPP_LAYERS}: give one")
        counts, parse_problems = parse_layout(p.pipeline_model_parallel_layout)
        problems += parse_problems
        problems += explicit_layout_problems(counts, plan.num_layers, pp, vpp) if counts else []
        vpp = len(counts) // pp if counts and len(counts) % pp == 0 else vpp
    if spec.interleaved and vpp == 1:
        problems.append(
            f"--parallel {spec.name} needs virtual stages: set {VPP_LAYERS} or {VPP} (2 or more)"
        )
    if problems:
        return None, problems
    if counts is None:
        problems += layout_problems(plan.num_layers, pp, vpp, first, last)
    problems += table_problems(spec, pp, vpp, config.num_microbatches)
    if problems:
        return None, problems
    layout = pipeline_layout(plan.num_layers, pp, vpp, first, last, counts)
    return PipelineSetup(spec, layout), []
