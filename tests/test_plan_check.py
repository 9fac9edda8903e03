"""The planner run beside ``mega train`` (``mega.core.plan.check``): the child process plans the
run's config as ``mega plan`` would, and says in one line why when it cannot."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.check import GIB, PlanCheck, gpu_kind
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

RUN = (
    "--model gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    " --max-position-embeddings 32 --mock-data --tokenizer-type NullTokenizer --vocab-size 250"
    " --bf16 --global-batch-size 8 --micro-batch-size 2 --nproc-per-node 2"
    " --pipeline-model-parallel-size 2"
)
WAIT_S = 300  # a cold child imports torch and builds the model on a loaded 2-core machine


def test_the_child_plans_every_stage_as_the_planner_does():
    plugins = make_plugins()
    config = resolve_config(shlex.split(RUN), plugins)
    planned = PlanCheck(config, "h100").result(WAIT_S)
    assert planned is not None and planned.error == ""
    here = plan_run(config, plugins, BUILT_IN["h100"])
    assert planned.peak_gib_by_stage == pytest.approx(
        [stage.profile.peak_bytes / GIB for stage in here.stages]
    )
    assert planned.tokens_per_s == pytest.approx(here.tokens_per_second)
    line = planned.memory_line(planned.peak_gib * 1.1)
    assert "measured" in line and "planned" in line and "(-9.1%)" in line


def test_a_run_it_cannot_plan_is_one_line_saying_why():
    plugins = make_plugins()
    config = dataclasses.replace(resolve_config(shlex.split(RUN), plugins), model_name="nosuch")
    planned = PlanCheck(config, None).result(WAIT_S)
    assert planned is not None and "nosuch" in planned.error
    line = planned.memory_line(1.0)
    assert line.startswith(" > mega plan could not count this run: ") and "\n" not in line


def test_gpu_kinds_from_device_names():
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_kind("NVIDIA H200") == "h200"
    assert gpu_kind("Tesla V100-SXM2-32GB") is None
