"""JSONL -> mega preprocess -> mega train / data inspect, with Megatron's tokenizers: the user's path."""

from __future__ import annotations

import json
import math
import pydoc_data.topics
from pathlib import Path

import pytest
from tokenizer_files import train_gpt2_bpe, train_wordpiece

from conftest import lm_losses, run_mega

MODEL = ["--model", "gpt", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
         "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "3e-3",
         "--log-interval", "5", "--eval-interval", "10", "--eval-iters", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The pydoc topics as JSONL, one document per topic."""
    directory = tmp_path_factory.mktemp("corpus")
    path = directory / "topics.jsonl"
    with open(path, "w") as f:
        for name in sorted(pydoc_data.topics.topics):
            f.write(json.dumps({"id": name, "text": pydoc_data.topics.topics[name]}) + "\n")
    return path


def test_preprocess_then_train_with_gpt2_bpe(tmp_path: Path, corpus: Path):
    vocab, merges = train_gpt2_bpe(tmp_path, vocab_size=1000)
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                 "--merge-file", str(merges)]  # fmt: skip
    prefix = tmp_path / "data" / "topics"
    (tmp_path / "data").mkdir()
    done = run_mega(["preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                     "--append-eod", "--workers", "2", *tokenizer], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = f"{prefix}_text_document"
    assert Path(f"{data}.bin").is_file() and Path(f"{data}.idx").is_file()

    trained = run_mega(["train", *MODEL, "--train-iters", "30", "--data-path", data,
                        "--split", "949,50,1", *tokenizer], tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert "padded vocab (size: 1000) with 24 dummy tokens (new size: 1024)" in trained.stdout
    losses = {it: float(loss) for it, loss in lm_losses(trained.stdout).items()}
    assert abs(losses[1] - math.log(1024)) < 0.3
    assert losses[30] < losses[1] - 1.0
    assert "validation loss at iteration 10" in trained.stdout

    shown = run_mega(["data", "inspect", "--data-path", data, "--seq-length", "64", "--seed",
                      "1234", "--split", "949,50,1", "--sample", "0:2", "--json", *tokenizer],
                     tmp_path)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert all(len(r["tokens"]) == 64 and r["labels"][:-1] == r["tokens"][1:] for r in rows)


def test_sentence_level_preprocess_feeds_the_bert_dataset(tmp_path: Path, corpus: Path):
    vocab = train_wordpiece(tmp_path, lowercase=True)
    tokenizer = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab)]
    prefix = tmp_path / "bert"
    done = run_mega(["preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                     "--split-sentences", *tokenizer], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr

    from mega import BuildContext, DataRequest
    from mega.core.plugins.manager import make_plugins
    from mega.plugins.datasets.indexed import IndexedDataset

    data = f"{prefix}_text_sentence"
    indexed = IndexedDataset(data)
    assert len(indexed) > 2 * indexed.num_documents  # sentences, not whole documents
    plugins = make_plugins()
    spec = plugins.tokenizers.get("BertWordPieceLowerCase")
    tok = spec.build(spec.config_cls(vocab_file=str(vocab)))
    bert = plugins.datasets.get("bert")
    ctx = BuildContext(seed=1, device="cpu", params_dtype="float32", seq_length=64, tokenizer=tok)
    request = DataRequest(split="98,2,0", data_path=(data,), num_samples=(50, 5, 0))
    splits = bert.build(bert.config_cls(), request, ctx)
    sample = splits.train[0]
    text = list(sample["text"])
    assert text[0] == tok.cls and text.count(tok.sep) == 2
    assert 0 < sample["loss_mask"].sum() <= 0.15 * 64 + 1
