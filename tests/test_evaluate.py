"""``mega evaluate``: a checkpoint's validation and test loss are the ones its training run printed
for the same weights, in one process (to the digit) and at another layout (to rounding)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from mega.core.training.evaluation import last_evaluation_batch
from mega.testing.ranks import free_port

from conftest import TINY, mega_in_fork, run_mega

TRAIN = [
    *[a for a in TINY if a not in ("--eval-iters", "0")], "--mock-data", "--train-iters", "10",
    "--eval-interval", "5", "--eval-iters", "2", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip
EVAL_LINE = re.compile(
    r"^ (validation|test) loss (.*?) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|$", re.M
)


def eval_lines(stdout: str) -> dict[tuple[str, str], str]:
    """(split, when) -> the printed loss, as printed."""
    return {(split, when): loss for split, when, loss, _ in EVAL_LINE.findall(stdout)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    cwd = tmp_path_factory.mktemp("run")
    args = ["train", *TRAIN, "--save", "ckpt", "--save-interval", "5", "--ckpt-format", "zarr"]
    (result,) = mega_in_fork([args], cwd)
    assert result.exit_code == 0, result.stderr
    return cwd, eval_lines(result.output)


def evaluate(cwd: Path, *args: str) -> tuple[dict, str]:
    """``mega evaluate ARGS`` in a fork of this process, as the training ran (the losses printed
    by both are compared digit for digit); a launched layout (``--nproc-per-node``) through the
    real console entry point."""
    if "--nproc-per-node" in args:
        launched = run_mega(["evaluate", *args], cwd)
        assert launched.returncode == 0, launched.stderr
        return eval_lines(launched.stdout), launched.stdout
    (result,) = mega_in_fork([["evaluate", *args]], cwd)
    assert result.exit_code == 0, result.stderr
    return eval_lines(result.output), result.output


def test_the_last_checkpoint_gives_the_end_of_training_losses(trained):
    cwd, printed = trained
    lines, _ = evaluate(cwd, "--load", "ckpt")
    when = "of the checkpoint at iteration 10"
    assert lines[("validation", when)] == printed[("validation", "at the end of training")]
    assert lines[("test", when)] == printed[("test", "at the end of training")]


def test_an_earlier_checkpoint_gives_its_iterations_validation_loss(trained):
    cwd, printed = trained
    lines, _ = evaluate(cwd, "--load", "ckpt/iter_0000005")
    assert (
        lines[("validation", "of the checkpoint at iteration 5")]
        == printed[("validation", "at iteration 5")]
    )


def test_another_layout_gives_the_same_loss(trained):
    """TP=2 on two launched processes: the same function, its sums split differently. fp32 dot
    products of n <= 128 terms are exact to n * 2^-24 ~ 8e-6 relative: 1e-5 bounds the loss."""
    cwd, printed = trained
    layout = ["--tensor-model-parallel-size", "2", "--nproc-per-node", "2"]
    lines, stdout = evaluate(cwd, "--load", "ckpt", *layout, "--master-port", str(free_port()))
    assert "tp 2" in stdout
    got = float(lines[("validation", "of the checkpoint at iteration 10")])
    want = float(printed[("validation", "at the end of training")])
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)


def test_other_data_named_by_flags(trained):
    """--valid-data-path alone: the run's mock data is dropped, its tokenizer kept, and the
    whole file is the validation split; the same file as --data-path with the default split
    gives another loss (3% of it)."""
    import numpy as np

    from mega.plugins.datasets.indexed import IndexedDatasetBuilder

    cwd, printed = trained
    builder = IndexedDatasetBuilder(cwd / "held_out", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(64):
        builder.add_document([rng.integers(0, 256, size=300).tolist()])
    builder.finalize()
    losses = []
    for data in (["--valid-data-path", "held_out"], ["--valid-data-path", "1", "held_out"],
                 ["--data-path", "held_out"]):  # fmt: skip
        lines, stdout = evaluate(cwd, "--load", "ckpt", *data)
        losses.append(lines[("validation", "of the checkpoint at iteration 10")])
        assert "data gpt, tokenizer ByteTokenizer," in stdout  # not the run's mock data
    mock = printed[("validation", "at the end of training")]
    assert losses[0] == losses[1] != losses[2] and mock not in losses  # a weight of 1: the same


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "error: mega evaluate needs --load CHECKPOINT"),
        (["--load", "nowhere"], "error: --load nowhere: no complete checkpoint there"),
        (["--load", "ckpt", "--eval-iters", "0"], "error: --eval-iters 0: nothing to evaluate"),
    ],
)
def test_bad_input_is_one_line(trained, args, message):
    cwd, _ = trained
    result = run_mega(["evaluate", *args], cwd)
    assert result.returncode == 2 and result.stderr.strip() == message, result.stderr


@pytest.mark.parametrize(
    "iteration, batch",
    [
        (0, 0),  # never trained (a converted checkpoint): the first batches
        (5, 0),  # the periodic evaluation at 5 began at batch 0
        (10, 4),  # train_iters: after the periodic ones at 5 and 10 (2 batches each)
        (7, 2),  # not an evaluation iteration: the next evaluation's batches
    ],
)
def test_last_evaluation_batch(iteration, batch):
    assert last_evaluation_batch(iteration, train_iters=10, interval=5, eval_iters=2) == batch


def test_last_evaluation_batchs_old_path_warns_and_forwards():
    import mega.core.training.engine as engine
    import mega.core.training.evaluation as evaluation

    with pytest.warns(DeprecationWarning, match="since 2026-11-27: use .*training.evaluation"):
        assert engine.last_evaluation_batch is evaluation.last_evaluation_batch
