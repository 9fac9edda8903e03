"""``mega data inspect``: the summary, decoded samples, JSON lines, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mega.cli import main
from mega.plugins.datasets.gpt.builder import build_gpt_splits
from mega.plugins.datasets.gpt.samples import SampleOptions
from mega.plugins.datasets.indexed import IndexedDatasetBuilder

from conftest import run_mega

VOCAB = 50  # NullTokenizer --vocab-size 50: ids 0..49, EOD = 50


@pytest.fixture
def corpus(tmp_path: Path) -> str:
    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    for _ in range(100):
        builder.add_document([[*rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist(), VOCAB]])
    builder.finalize()
    return str(prefix)


def inspect(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(["data", "inspect", *args])
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def expected_train(corpus: str, train_samples=None, seq_length=8, seed=3, split="90,10,0"):
    options = SampleOptions(seq_length=seq_length, eod=VOCAB)
    return build_gpt_splits([corpus], split, (train_samples, 0, 0), seed, options).splits[0]


def test_json_lines_are_the_training_samples(corpus, capsys):
    code, out, err = inspect(
        ["--data-path", corpus, "--split", "90,10,0", "--seq-length", "8", "--seed", "3",
         "--train-samples", "400", "--sample", "2:6", "--json"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    train = expected_train(corpus, 400)
    assert [row["index"] for row in rows] == [2, 3, 4, 5]
    for row in rows:
        assert row["tokens"] == train[row["index"]]["tokens"].tolist()
        assert row["labels"] == train[row["index"]]["labels"].tolist()
        assert row["tokens"][1:] == row["labels"][:-1]
    assert "train" in err and "samples" in err  # the summary stays off stdout


def test_text_output_decodes_through_the_tokenizer(corpus, capsys):
    code, out, err = inspect(
        ["--data-path", corpus, "--split", "90,10,0", "--seq-length", "8", "--seed", "3",
         "--sample", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    train = expected_train(corpus)  # one epoch by default
    tokens = train[1]["tokens"].tolist()
    lines = out.splitlines()
    assert lines[lines.index("--- sample 1 ---") + 1] == " ".join(map(str, tokens))
    summary = {line.split()[0]: line for line in lines if " documents " in line}
    assert "documents 90," in summary["train"]
    assert f"samples {len(train):,}" in summary["train"] and "epochs 1" in summary["train"]
    assert "documents 10," in summary["valid"]
    assert "index cache: built" in out


def test_summary_counts_tokens_per_split(corpus, capsys):
    from mega.plugins.datasets.indexed import IndexedDataset

    lengths = IndexedDataset(corpus).sequence_lengths
    code, out, _ = inspect(
        ["--data-path", corpus, "--split", "90,10,0", "--seq-length", "8"], capsys
    )
    assert code == 0
    rows = [line for line in out.splitlines() if " documents " in line]
    train_line, valid_line = rows[0], rows[1]
    assert train_line.startswith("train") and valid_line.startswith("valid")
    assert f"tokens {int(lengths[:90].sum()):,}," in train_line
    assert f"tokens {int(lengths[90:].sum()):,}," in valid_line
    assert f"samples {(int(lengths[90:].sum()) - 1) // 8:,}" in valid_line


def test_train_data_path_is_the_whole_train_split(corpus, capsys):
    """As mega train's --train-data-path: every document of the prefix is train data."""
    code, out, err = inspect(
        ["--train-data-path", corpus, "--seq-length", "8", "--seed", "3", "--sample", "0:4",
         "--json"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    train = expected_train(corpus, split="1,0,0")
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == [
        train[i]["tokens"].tolist() for i in range(4)
    ]
    assert "documents 100," in err


def test_second_run_loads_the_cache(corpus, capsys):
    args = ["--data-path", corpus, "--seq-length", "8", "--sample", "0", "--json"]
    assert inspect(args, capsys)[0] == 0
    code, out, err = inspect(args, capsys)
    assert code == 0 and "index cache: loaded" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--data-path", "/nope/corpus"],
            "error: --data-path /nope/corpus: no such file /nope/corpus.idx",
        ),
        (["--seq-length", "8"], "error: --data-path (or --train-data-path) is required"),
        (
            ["--data-path", "x", "--train-data-path", "y"],
            "error: --data-path and --train-data-path: give one of them",
        ),
        (
            ["--sample", "10000:10002"],
            "error: --sample 10000:10002: out of range; the train split has",
        ),
        (["--sample", "a:b"], "error: --sample 'a:b': expected i or i:j"),
        (["--seq-length", "4000"], "too few for one sample of --seq-length 4000"),
        (["--bogus"], "error: unknown flag --bogus"),
    ],
    ids=[
        "missing-prefix",
        "no-data-path",
        "both-paths",
        "sample-range",
        "sample-syntax",
        "too-short",
        "flag",
    ],
)
def test_errors_are_one_line_with_exit_code_2(args, message, corpus, capsys):
    if "--data-path" not in args and "is required" not in message:
        args = ["--data-path", corpus, *args]
    code, out, err = inspect(args, capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_the_mega_command_runs_it(corpus, tmp_path):
    result = run_mega(
        [
            "data",
            "inspect",
            "--data-path",
            corpus,
            "--seq-length",
            "8",
            "--sample",
            "0:2",
            "--json",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["index"] for line in result.stdout.splitlines()] == [0, 1]
    help_text = run_mega(["data", "inspect", "--help"], cwd=tmp_path).stdout
    assert "--train-samples" in help_text and "--reset-position-ids" in help_text
