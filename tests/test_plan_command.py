"""``mega plan``: the per-stage table and step estimate, --search's ready-to-run command lines,
and the one-line refusals."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mega import ModelSpec, hookimpl
from mega.cli import make_cli
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError

SMALL = (
    "--model gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    " --max-position-embeddings 32 --mock-data --tokenizer-type NullTokenizer --vocab-size 250"
    " --bf16 --global-batch-size 8 --micro-batch-size 2"
)


# a global batch of 2 (micro-batch 1, so that the flags resolve at data-parallel 2), not SMALL's
# 8: each layout is then searched at micro-batch 1 and 2 only, not up to 8
SEARCHED = [
    *shlex.split(SMALL.replace("--global-batch-size 8 --micro-batch-size 2", "")),
    *("--global-batch-size", "2", "--micro-batch-size", "1"),
]


def _plan(*args: str):
    return CliRunner().invoke(make_cli(make_plugins()), ["plan", *shlex.split(SMALL), *args])


def test_plan_prints_every_pipeline_stage_and_the_step():
    result = _plan("--gpus=2", "--pipeline-model-parallel-size", "2", "--gpu", "H100")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["0", "1"]  # one row per stage
    assert all(row.split("│")[-2].strip() == "yes" for row in rows)
    assert "tokens/s" in result.output and "bubble" in result.output


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_a_model_alone_is_planned_with_mega_trains_defaults(model):
    # docs/commands.md's `mega plan --model gpt`: no --global-batch-size, so the default (micro-batch
    # x data-parallel size) is planned, as mega train would train it (issue 49: a TypeError)
    result = CliRunner().invoke(make_cli(make_plugins()), ["plan", "--model", model])
    assert result.exit_code == 0, result.output
    assert "micro-batch 16 x 1" in result.output
    assert "tokens/s" in result.output


def test_search_without_a_global_batch_searches_the_default_one():
    # 1 GPU, micro-batch 16 by default: every layout tried trains a global batch of 16 (each
    # layout's own default would differ; without the flag, --search was a TypeError)
    args = ["plan", "--model", "gpt", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "2", "--gpus", "1", "--search", "--top", "2"]  # fmt: skip
    result = CliRunner().invoke(make_cli(make_plugins()), args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line[:3] in ("1. ", "2. ")]
    assert len(lines) == 2
    assert all("--global-batch-size 16" in line for line in lines), lines


def test_search_does_not_hold_the_global_batch_to_a_micro_batch_it_replaces():
    # global batch 8, no --micro-batch-size: the default 16 does not divide 8, which stopped
    # --search before it tried a layout (it picks the micro-batch itself)
    from mega.cli.plan_search import without_micro_batch

    args = ["--global-batch-size", "8", "--micro-batch-size=16", "--nproc-per-node", "4"]
    assert without_micro_batch(args) == ["--global-batch-size", "8", "--nproc-per-node", "4"]
    args = [
        "plan",
        "--model",
        "gpt",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "2",
        "--global-batch-size",
        "8",
        "--gpus",
        "1",
        "--no-compile",
        "--search",
        "--top",
        "1",
    ]  # fmt: skip  (eager: counted faster)
    result = CliRunner().invoke(make_cli(make_plugins()), args)
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("1. mega train")]


def test_search_prints_runnable_train_commands_fastest_first():
    # SEARCHED: every (tensor-parallel layout, micro-batch) pair is one more compile on meta, so
    # few micro-batches. Still 7 layouts found (tp1 pp1, tp1 pp2, tp2, tp2-sp), tensor-parallel
    # ones among them, for the top 3.
    # eager layers: a compiled one is counted by compiling it on meta, once per layout (46 s)
    command = ["plan", *SEARCHED, "--no-compile", "--gpus", "2", "--search", "--top", "3"]
    result = CliRunner().invoke(make_cli(make_plugins()), command)
    assert result.exit_code == 0, result.output
    # off a terminal each layout shape done is a line on stderr; stdout keeps the table
    reports = [line for line in result.stderr.splitlines() if line.startswith("searched ")]
    assert [line.split()[1] for line in reports] == ["1/4", "2/4", "3/4", "4/4"]
    assert "searched" not in result.stdout
    lines = [line for line in result.output.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
    assert len(lines) == 3
    speeds = [
        float(line.split("│")[3].replace(",", ""))
        for line in result.output.splitlines()
        if line.startswith("│")
    ]
    assert speeds == sorted(speeds, reverse=True)
    # each is a mega train command the config accepts
    from mega.core.config.resolve import resolve_config

    for line in lines:
        words = shlex.split(line[3:])
        assert words[:2] == ["mega", "train"]
        resolve_config(words[2:], make_plugins())


def test_search_by_forked_processes_finds_what_one_process_finds():
    # a 6.7B model's search of 8 GPUs took 14.6 min in one process on a 2-core machine, with
    # nothing printed until the end: the shapes are now counted by --jobs forked processes
    # and each one done is reported; the layouts found, their order and numbers must not move
    from mega.cli.plan_search import search
    from mega.core.config.resolve import resolve_config
    from mega.core.plan.calibration import rates_for

    args = [*SEARCHED, "--no-compile", "--nproc-per-node", "2"]
    plugins = make_plugins()
    config = resolve_config(args, plugins, this_machine=False)
    heard: dict[int, list] = {1: [], 2: []}
    found = {}
    for jobs in (1, 2):

        def progress(*call: object, jobs: int = jobs) -> None:
            heard[jobs].append(call)

        found[jobs] = search(config, args, plugins, rates_for("h200"), 80 * 2**30, jobs, progress)
    assert found[1] and found[1] == found[2]
    for calls in heard.values():  # (0, total, "") first, then every shape once
        total = calls[0][1]
        assert calls[0] == (0, total, "") and total == 4  # tp1 pp1, tp1 pp2, tp2, tp2-sp
        assert [done for done, _, _ in calls[1:]] == [1, 2, 3, 4]
        assert sorted(name for _, _, name in calls[1:]) == [
            "tp1 pp1",
            "tp1 pp2",
            "tp2 pp1",
            "tp2-sp pp1",
        ]


def _dies_at_the_second_shape(shape: tuple) -> list:
    if shape == (1, 2, 1, False):
        os._exit(9)  # as the kernel's OOM killer would end it
    return []


def _refuses_the_second_shape(shape: tuple) -> list:
    if shape == (1, 2, 1, False):
        raise MegaUsageError("model 'x' cannot be planned")
    return []


def test_a_search_worker_that_dies_or_refuses_stops_the_search_in_one_line(monkeypatch):
    from mega.cli import plan_search
    from mega.errors import MegaRunError

    shapes = [(1, 1, 1, False), (1, 2, 1, False), (2, 1, 1, False)]
    monkeypatch.setattr(plan_search, "_search_shape", _dies_at_the_second_shape)
    with pytest.raises(MegaRunError, match="a worker process died counting tp1 pp2 .*--jobs 1"):
        plan_search._each_shape(shapes, 2, None)
    monkeypatch.setattr(plan_search, "_search_shape", _refuses_the_second_shape)
    with pytest.raises(MegaUsageError, match="model 'x' cannot be planned"):
        plan_search._each_shape(shapes, 2, None)


def test_jobs_belongs_to_search(mega_cli):
    result = mega_cli(["plan", *shlex.split(SMALL), "--gpus", "2", "--jobs", "2"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --jobs is for --search (one plan is counted in this process)"
    )


def test_an_fp16_run_with_its_loss_scaler_is_planned():
    # the dynamic loss scaler asks the host whether a gradient overflowed, which a meta tensor
    # cannot answer (a 2-GPU fp16 run's plan check said "could not count this run", 2026-11-28)
    args = shlex.split(SMALL.replace("--bf16", "--fp16"))
    result = CliRunner().invoke(make_cli(make_plugins()), ["plan", *args, "--gpu", "h100"])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output


def test_a_gpu_run_in_fp8_is_planned_on_a_machine_without_a_gpu():
    # the plan is for --gpu's kind: this machine's devices are not asked
    result = _plan("--device", "cuda", "--fp8-format", "hybrid", "--gpu", "h100")
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output


def test_a_delayed_fp8_run_is_planned_as_tensorwise(recwarn):
    """Its compiled graph on meta would fail on the in-place amax records, and the planner would
    count its layers as eager (warning so); the plan counts the tensorwise graph instead."""
    fp8 = ["--device", "cuda", "--fp8-format", "hybrid", "--gpu", "h100"]
    delayed = _plan(*fp8, "--fp8-recipe", "delayed")
    assert delayed.exit_code == 0, delayed.output
    assert not [w for w in recwarn if "could not be compiled on meta" in str(w.message)]
    tensorwise = _plan(*fp8)
    step = [line for line in delayed.output.splitlines() if line.startswith("step ")]
    assert step and step == [ln for ln in tensorwise.output.splitlines() if ln.startswith("step ")]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpu", "tpu9"], "--gpu tpu9: no rates for it"),
        (["--gpus", "2", "--nproc-per-node", "2"], "--gpus and --nproc-per-node"),
        (["--gpus"], "--gpus needs a value"),
        (["--gpus=2", "--search", "--top", "0"], "--top must be >= 1"),
        (["--gpus=two"], "--gpus: not a valid value: 'two'"),
    ],
)
def test_bad_plan_flags_are_refused_by_name(args, message):
    result = _plan(*args)
    assert isinstance(result.exception, MegaUsageError)
    assert message in str(result.exception)


def test_calibrate_without_a_gpu_is_one_error_line_exit_2():
    done = subprocess.run(
        [sys.executable, "-m", "mega", "plan", "--calibrate"], capture_output=True, text=True
    )
    if done.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: calibration measures a GPU, and this machine has none"


class HostReadingGPT:
    """A model plugin whose forward reads a tensor's value on the host: it cannot run on meta."""

    @hookimpl
    def register_models(self, register):
        from mega.plugins.models.gpt import GPTConfig, _build, flops_per_token

        def build(cfg, ctx):
            model = _build(cfg, ctx)
            forward = model.forward

            def reading(tokens, labels=None, **kwargs):
                if tokens.max().item() < 0:  # the host read
                    raise AssertionError("token ids are never negative")
                return forward(tokens, labels, **kwargs)

            model.forward = reading
            return model

        register(ModelSpec(name="gpt-host-reading", config_cls=GPTConfig, build=build,
                           flops_per_token=flops_per_token))  # fmt: skip


def test_a_model_that_cannot_run_on_meta_is_one_line_naming_it_and_where():
    plugins = make_plugins(extra=[("host-reading", HostReadingGPT())])
    args = ["plan", *shlex.split(SMALL.replace("--model gpt", "--model gpt-host-reading"))]
    result = CliRunner().invoke(make_cli(plugins), args)
    assert isinstance(result.exception, MegaUsageError)
    message = str(result.exception)
    assert message.startswith("model 'gpt-host-reading' cannot be planned: it does not run its")
    assert "Tensor.item()" in message and f"{Path(__file__).name}:" in message
