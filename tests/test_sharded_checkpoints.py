"""Sharded zarr checkpoints: saved at one layout, loaded at another, the run goes on as if
uninterrupted (the single-process run's losses and final parameters); at the same layout it
resumes bit-exactly. The first half of each pair stops after iteration 4 with --exit-interval."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_runs import EQUIVALENCE, assert_same_training, layout_run

# 4 layers so that PP2 interleaved has one layer per virtual stage; 4 micro-batches at DP1
ARGS = [*EQUIVALENCE, "--num-layers", "4", "--train-iters", "8"]
TP2 = ["--tensor-model-parallel-size", "2"]
DP_DISTOPT = ["--use-distributed-optimizer"]
PP2_INTERLEAVED = [
    "--pipeline-model-parallel-size", "2", "--parallel", "interleaved",
    "--num-layers-per-virtual-pipeline-stage", "1",
]  # fmt: skip
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return layout_run(ARGS, 1, str(tmp_path_factory.mktemp("single")))[0]


def save_then_load(tmp_path: Path, first: tuple[int, list], second: tuple[int, list]) -> dict:
    """Train to iteration 4 at ``first`` (world size, flags) with --save, then resume at
    ``second`` to iteration 8; rank 0's result of the second run."""
    ckpt = str(tmp_path / "ckpt")
    (world_a, flags_a), (world_b, flags_b) = first, second
    saved = layout_run(
        [*ARGS, *flags_a, "--save", ckpt, "--exit-interval", "4"], world_a, str(tmp_path / "a")
    )[0]
    assert len(saved["losses"]) == 4
    assert (tmp_path / "ckpt" / "iter_0000004" / "complete.json").is_file()
    return layout_run([*ARGS, *flags_b, "--load", ckpt], world_b, str(tmp_path / "b"))[0]


def tail(run: dict, first: int) -> dict:
    """``run`` from iteration ``first`` + 1 on."""
    return {**run, "losses": run["losses"][first:], "grad_norms": run["grad_norms"][first:]}


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((1, []), (2, TP2)),
        ((2, TP2), (2, DP_DISTOPT)),
        ((4, [*TP2, *DP_DISTOPT]), (2, PP2_INTERLEAVED)),
        ((2, PP2), (1, [])),
        ((4, DP_DISTOPT), (2, DP_DISTOPT)),
        ((4, [*CP2, *DP_DISTOPT]), (2, TP2)),
        ((1, []), (2, [*CP2, *DP_DISTOPT])),
    ],
    ids=["1-to-tp2", "tp2-to-dp2-distopt", "tp2dp2-distopt-to-pp2-interleaved", "pp2-to-1",
         "dp4-distopt-to-dp2-distopt", "cp2dp2-distopt-to-tp2", "1-to-cp2-distopt"],
)  # fmt: skip
def test_resharded_resume_continues_the_single_process_run(single, tmp_path, first, second):
    resumed = save_then_load(tmp_path, first, second)
    assert_same_training(tail(single, 4), resumed)


def test_untied_model_reshards_tp2_sequence_parallel_to_pp2(tmp_path):
    untied = [*ARGS, "--untie-embeddings-and-output-weights"]
    reference = layout_run(untied, 1, str(tmp_path / "ref"))[0]
    ckpt = str(tmp_path / "ckpt")
    layout_run([*untied, *TP2, "--sequence-parallel", "--save", ckpt, "--exit-interval", "4"], 2,
               str(tmp_path / "a"))  # fmt: skip
    resumed = layout_run([*untied, *PP2, "--load", ckpt], 2, str(tmp_path / "b"))[0]
    assert_same_training(tail(reference, 4), resumed)


@pytest.mark.parametrize(
    ("world", "flags"),
    [(2, TP2), (2, DP_DISTOPT), (2, PP2_INTERLEAVED)],
    ids=["tp2", "dp2-distopt", "pp2-interleaved"],
)
def test_same_layout_resumes_bit_exactly(tmp_path, world, flags):
    uninterrupted = layout_run([*ARGS, *flags], world, str(tmp_path / "u"))[0]
    resumed = save_then_load(tmp_path, (world, flags), (world, flags))
    assert resumed["losses"] == uninterrupted["losses"][4:]  # every digit
    assert resumed["grad_norms"] == uninterrupted["grad_norms"][4:]
    for name, value in uninterrupted["params"].items():
        # the vocabulary's padding rows are not part of the model (nor of its checkpoint)
        rows = uninterrupted["vocab_rows"].get(name, value.shape[0])
        assert resumed["params"][name][:rows].equal(value[:rows]), name
