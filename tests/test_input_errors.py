"""Issue 15 item 2: bad input that used to end in a traceback, a cascade of errors, a far-fetched
suggestion or silence now gives one clear line each, every configuration error together."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mega.errors import closest
from mega.parallel.topology import layout_problems


def errors_of(result) -> list[str]:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output + result.stderr
    assert "Traceback" not in result.stderr
    return [line for line in lines if line.startswith("error: ")]


def one_error(result, *fragments: str) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warn")]
    assert result.exit_code == 2, result.output + result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def write_dataset(prefix: Path, largest: int) -> None:
    from mega.plugins.datasets.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(64):
        builder.add_document([rng.integers(0, 200, size=40).tolist()])
    builder.add_document([[5, largest, 7]])
    builder.finalize()


def test_data_tokenized_with_a_larger_vocabulary_is_refused(mega_cli, tiny_gpt, tmp_path):
    write_dataset(tmp_path / "corpus", largest=50256)
    args = ["train", *tiny_gpt, "--data-path", str(tmp_path / "corpus"), "--train-iters", "1"]
    result = mega_cli([*args, "--tokenizer-type", "ByteTokenizer"])
    one_error(result, "holds token id 50256", "ByteTokenizer has 258 ids")
    # the answer is cached next to the dataset's index cache: a second run reads it
    assert list((tmp_path / "cache").rglob("largest_token_id-*.json"))


def test_data_within_the_vocabulary_trains(mega_cli, tiny_gpt, tmp_path):
    write_dataset(tmp_path / "corpus", largest=257)
    args = ["train", *tiny_gpt, "--data-path", str(tmp_path / "corpus"), "--train-iters", "1"]
    result = mega_cli([*args, "--tokenizer-type", "ByteTokenizer"])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("target", ["/proc/foo", "/sys/x"])
def test_save_where_no_directory_can_be_made(mega_cli, tiny_gpt, target):
    if not os.path.isdir(os.path.dirname(target)):
        pytest.skip(f"no {os.path.dirname(target)} here")
    result = mega_cli(["train", *tiny_gpt, "--save", target, "--train-iters", "1"])
    one_error(result, f"--save {target}: not a writable directory")


def test_device_cuda_without_cuda(mega_cli, tiny_gpt):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = mega_cli(["train", *tiny_gpt, "--device", "cuda", "--train-iters", "1"])
    one_error(result, "--device cuda:")


def test_a_dataset_that_does_not_give_the_model_what_it_needs(mega_cli, tiny_gpt):
    result = mega_cli(["train", *tiny_gpt, "--dataset", "bert", "--train-iters", "1"])
    joined = "\n".join(errors_of(result))
    assert "model 'gpt' needs batch keys tokens that dataset 'bert' does not provide" in joined


def test_every_configuration_error_together(mega_cli, tiny_gpt):
    args = ["train", *tiny_gpt, "--global-batch-size", "6", "--data-path", "nowhere",
            "--tokenizer-type", "ByteTokenizer", "--seq-length", "256",
            "--max-position-embeddings", "128", "--save", "/proc/foo"]  # fmt: skip
    joined = "\n".join(errors_of(mega_cli(args)))
    for fragment in (
        "--global-batch-size (6) must be divisible",
        "--data-path nowhere: no such file nowhere.idx",
        "--seq-length (256) exceeds --max-position-embeddings (128)",
        *(["--save /proc/foo: not a writable directory"] if os.path.isdir("/proc") else []),
    ):
        assert fragment in joined, joined


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--train-iters", "-1"], "--train-iters must be at least 1"),
        (["--lr", "-1"], "--lr must be a positive number"),
    ],
)
def test_one_mistake_is_one_error(mega_cli, tiny_gpt, flags, expected):
    one_error(mega_cli(["train", *tiny_gpt, *flags]), expected)


def test_did_you_mean_only_for_close_matches(mega_cli, tiny_gpt):
    assert closest("--wandb-project", ["--adam-beta2", "--nnodes"]) is None
    assert closest("--finetune", ["--adam-beta2", "--nnodes"]) is None
    assert closest("--num-layer", ["--num-layers", "--num-layers-per-virtual-pipeline-stage"]) == (
        "--num-layers"
    )
    assert closest("gtp", ["gpt", "bert"]) == "gpt"
    line = one_error(mega_cli(["train", *tiny_gpt, "--colour-scheme", "dark"]))
    assert line == "error: unknown flag --colour-scheme"
    one_error(mega_cli(["train", *tiny_gpt, "--seq-len", "8"]), "did you mean --seq-length?")


def test_world_size_error_wording():
    (one,) = layout_problems(3, {"tp": 2, "cp": 1, "ep": 1, "pp": 1})
    assert one == (
        "the world size (3 processes) is not divisible by --tensor-model-parallel-size (2)"
    )
    (two,) = layout_problems(6, {"tp": 2, "cp": 1, "ep": 1, "pp": 2})
    assert two.endswith("by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4")


def test_odd_blend_list_says_which_is_wrong(mega_cli, tiny_gpt):
    args = ["--data-path", "0.7", "a", "b", "--tokenizer-type", "ByteTokenizer"]
    one_error(
        mega_cli(["train", *tiny_gpt, *args]),
        "--data-path 0.7 a b: '0.7' looks like a blend weight",
        "do not pair up",
    )


def test_save_interval_without_save(mega_cli, tiny_gpt):
    one_error(mega_cli(["train", *tiny_gpt, "--save-interval", "5"]), "--save-interval 5", "--save")


def test_resume_warnings_name_real_values_and_a_finished_run(mega_cli, tiny_gpt, tmp_path):
    flags = [f for f in tiny_gpt]
    i = flags.index("--global-batch-size")
    del flags[i : i + 2]  # the first run leaves the global batch at its default (4)
    flags += ["--lr-decay-iters", "10"]  # the same schedule whatever --train-iters
    ckpt = str(tmp_path / "ckpt")
    first = mega_cli(["train", *flags, "--train-iters", "2", "--save", ckpt])
    assert first.exit_code == 0, first.stderr
    same = mega_cli(["train", *flags, "--global-batch-size", "4", "--train-iters", "3",
                     "--load", ckpt])  # fmt: skip
    assert same.exit_code == 0, same.stderr
    assert "warning" not in same.stderr, same.stderr  # 4 is what the first run used
    other = mega_cli(["train", *flags, "--global-batch-size", "8", "--train-iters", "3",
                      "--load", ckpt])  # fmt: skip
    assert other.exit_code == 0, other.stderr
    assert "--global-batch-size is 8 but the checkpoint was trained with 4" in other.stderr
    assert "None" not in other.stderr
    done = mega_cli(["train", *flags, "--train-iters", "2", "--load", ckpt])
    assert done.exit_code == 0, done.stderr
    assert "warning: the checkpoint is at iteration 2 and --train-iters is 2: nothing" in (
        done.stderr
    )
