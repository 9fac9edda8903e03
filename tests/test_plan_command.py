"""``mega plan``: the per-stage table and step estimate, --search's ready-to-run command lines,
and the one-line refusals."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mega.cli import make_cli
from mega.core.errors import MegaUsageError
from mega.core.plugins.manager import make_plugins

SMALL = (
    "--model gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    " --max-position-embeddings 32 --mock-data --tokenizer-type NullTokenizer --vocab-size 250"
    " --bf16 --global-batch-size 8 --micro-batch-size 2"
)


def _plan(*args: str):
    return CliRunner().invoke(make_cli(make_plugins()), ["plan", *shlex.split(SMALL), *args])


def test_plan_prints_every_pipeline_stage_and_the_step():
    result = _plan("--gpus=2", "--pipeline-model-parallel-size", "2", "--gpu", "H100")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["0", "1"]  # one row per stage
    assert all(row.split("│")[-2].strip() == "yes" for row in rows)
    assert "tokens/s" in result.output and "bubble" in result.output


def test_search_prints_runnable_train_commands_fastest_first():
    result = _plan("--gpus", "2", "--search", "--top", "3")
    assert result.exit_code == 0, result.output
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
