"""`mega train --model bert` / `--model t5` as a user types them: on the embedded text with no
data flag, on a corpus made by `mega preprocess --split-sentences`, and refused (one line, exit
code 2) when the dataset does not give the model what it needs."""

from __future__ import annotations

import json
import pydoc_data.topics
import re
from pathlib import Path

import pytest
from tokenizer_files import train_wordpiece

from conftest import lm_losses, run_mega

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
         "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "8",
         "--lr", "3e-3", "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "1",
         "--train-iters", "20"]  # fmt: skip
SOP = re.compile(r"iteration\s+(\d+)/.*?\| sop loss: ([0-9.E+-]+) \|")


def _losses(stdout: str) -> dict[int, float]:
    return {it: float(loss) for it, loss in lm_losses(stdout).items()}


def _trains(done, model: str) -> dict[int, float]:
    """The run succeeded, printed its model's loss parts, and its lm loss fell."""
    assert done.returncode == 0, done.stderr
    losses = _losses(done.stdout)
    assert sorted(losses) == [1, 10, 20], done.stdout
    assert losses[20] < losses[1] - 0.5, losses  # from about ln(V) at the start
    sop = dict(SOP.findall(done.stdout))
    evaluation = [line for line in done.stdout.splitlines() if "validation loss" in line]
    assert evaluation and "lm loss value" in evaluation[-1]
    if model == "bert":  # both parts, on every iteration line and the evaluation line
        assert sorted(int(it) for it in sop) == [1, 10, 20]
        assert all(0.3 < float(v) < 1.5 for v in sop.values())  # a 2-way cross-entropy
        assert "sop loss value" in evaluation[-1]
    else:
        assert not sop and "sop loss" not in evaluation[-1]
    return losses


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_trains_on_the_embedded_text_with_no_data_flag(tmp_path: Path, model: str):
    done = run_mega(["train", "--model", model, *SMALL], tmp_path)
    _trains(done, model)
    assert f"data {model}, tokenizer EmbeddedWordPiece" in done.stdout
    metrics = [json.loads(line) for line in next(tmp_path.glob("runs/*/metrics.jsonl")).open()]
    keys = {"lm_loss", "sop_loss"} if model == "bert" else {"lm_loss"}
    assert keys <= set(metrics[0]) and ("sop_loss" in metrics[0]) == (model == "bert")


@pytest.fixture(scope="module")
def sentence_corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """The pydoc topics preprocessed at sentence level with a WordPiece vocab.txt (and the
    tokenizer flags that read it, with T5's sentinels)."""
    directory = tmp_path_factory.mktemp("sentences")
    corpus = directory / "topics.jsonl"
    with open(corpus, "w") as f:
        for name in sorted(pydoc_data.topics.topics):
            f.write(json.dumps({"text": pydoc_data.topics.topics[name]}) + "\n")
    vocab = train_wordpiece(directory, lowercase=True)
    tokenizer = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab),
                 "--vocab-extra-ids", "100"]  # fmt: skip
    prefix = directory / "topics"
    done = run_mega(["preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                     "--split-sentences", *tokenizer], directory)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return Path(f"{prefix}_text_sentence"), tokenizer


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_trains_on_a_preprocessed_sentence_corpus(tmp_path: Path, sentence_corpus, model: str):
    data, tokenizer = sentence_corpus
    extra = ["--decoder-seq-length", "32"] if model == "t5" else []
    done = run_mega(["train", "--model", model, *SMALL, *extra, "--data-path", str(data),
                     "--split", "949,50,1", *tokenizer], tmp_path)  # fmt: skip
    _trains(done, model)
    assert f"data {model}, tokenizer BertWordPieceLowerCase" in done.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--model", "bert", "--dataset", "embedded"], ("model 'bert'", "dataset 'embedded'")),
        (["--model", "t5", "--mock-data", "--dataset", "mock"], ("model 't5'", "dataset 'mock'")),
        (["--model", "gpt", "--dataset", "t5"], ("model 'gpt'", "dataset 't5'")),
        (["--model", "t5", "--dataset", "bert"], ("model 't5'", "dataset 'bert'")),
    ],
)
def test_a_dataset_without_the_models_keys_is_refused_naming_both(tmp_path, args, named):
    done = run_mega(["train", *args], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert all(name in lines[0] for name in named), lines[0]
