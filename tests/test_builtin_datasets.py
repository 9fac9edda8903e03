"""The --split parser, ShuffledWindows, and the embedded and mock datasets."""

from __future__ import annotations

import numpy as np
import pytest

from mega import BuildContext, DataRequest
from mega.core.plugins.manager import make_plugins
from mega.plugins.datasets.embedded_text import EmbeddedTextConfig, build_embedded, load_documents
from mega.plugins.datasets.mock import MockDataConfig, build_mock
from mega.plugins.datasets.splits import ShuffledWindows, parse_split, split_ranges
from mega.plugins.tokenizers.byte import ByteTokenizer
from mega.plugins.tokenizers.null import NullTokenizer


def _approx(matrix):
    return [None if m is None else pytest.approx(m) for m in matrix]


def _ctx(tokenizer, seq_length=128, seed=1234):
    return BuildContext(
        seed=seed, device="cpu", params_dtype="float32", seq_length=seq_length, tokenizer=tokenizer
    )


def _request(split="969,30,1", num_samples=(1000, 100, 10)):
    return DataRequest(split=split, data_path=(), num_samples=num_samples)


# --- split string -----------------------------------------------------------------------------


def test_parse_split_megatron_examples():
    assert parse_split("949,50,1") == _approx([(0, 0.949), (0.949, 0.999), (0.999, 1.0)])
    assert parse_split("1,1,1") == _approx([(0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0)])
    assert parse_split("100,0,0") == [(0.0, 1.0), None, None]
    assert parse_split("969,30,1") == _approx([(0, 0.969), (0.969, 0.999), (0.999, 1.0)])
    # Padding with zeros and any separator, as the regex [.0-9]+ allows.
    assert parse_split("98 2") == _approx([(0, 0.98), (0.98, 1.0), None])
    assert parse_split("0.5/0.5") == _approx([(0, 0.5), (0.5, 1.0), None])


def test_parse_split_rejects_bad_strings():
    with pytest.raises(ValueError, match="at most 3"):
        parse_split("1,1,1,1")
    with pytest.raises(ValueError, match="positive sum"):
        parse_split("0,0,0")
    # Megatron's regex finds the numbers in anything: 1,x,1 would train as 1,1,0 (issue 49)
    for bad in ("1,x,1", "-1,1,1", "1,,1", "1e3,1", ""):
        with pytest.raises(ValueError, match="expected numbers separated by commas"):
            parse_split(bad)


def test_split_ranges():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("969,30,1", 79) == [(0, 77), (77, 79), None]
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_ranges("100,0,0", 5) == [(0, 5), None, None]


# --- ShuffledWindows --------------------------------------------------------------------------


def test_shuffled_windows_samples_and_epochs():
    stream = np.arange(101)  # 100 // 10 = 10 windows per epoch
    src = ShuffledWindows(stream, seq_length=10, num_samples=25, seed=7, split_index=0)
    assert src.windows_per_epoch == 10 and src.num_epochs == 3 and len(src) == 30
    for i in range(len(src)):
        sample = src[i]
        assert sample["tokens"].dtype == np.int64 and sample["tokens"].shape == (10,)
        assert sample["loss_mask"].dtype == np.float32 and sample["loss_mask"].sum() == 10.0
        np.testing.assert_array_equal(sample["labels"], sample["tokens"] + 1)
        assert sample["tokens"][0] % 10 == 0  # every sample starts on a window boundary
    starts = [[int(src[e * 10 + j]["tokens"][0]) for j in range(10)] for e in range(3)]
    for epoch in starts:
        assert sorted(epoch) == list(range(0, 100, 10))  # each epoch visits every window once
    assert starts[0] != starts[1] and starts[1] != starts[2]


def test_shuffled_windows_are_deterministic():
    stream = np.random.default_rng(0).integers(0, 50, size=1000)
    a = ShuffledWindows(stream, 16, 400, seed=3, split_index=1)
    b = ShuffledWindows(stream, 16, 400, seed=3, split_index=1)
    assert (a.windows_per_epoch, a.num_epochs) == (62, 7)  # more epochs than the cache holds (4)
    order = [150, 3, 99, 62, 3, 380, 20, 250, 150]
    for i in order:
        np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])
    fresh = ShuffledWindows(stream, 16, 800, seed=3, split_index=1)  # more epochs, same prefix
    for i in reversed(range(len(a))):
        np.testing.assert_array_equal(a[i]["tokens"], fresh[i]["tokens"])
    other_seed = ShuffledWindows(stream, 16, 200, seed=4, split_index=1)
    other_split = ShuffledWindows(stream, 16, 200, seed=3, split_index=2)
    first = [a[i]["tokens"][0] for i in range(20)]
    assert first != [other_seed[i]["tokens"][0] for i in range(20)]
    assert first != [other_split[i]["tokens"][0] for i in range(20)]


def test_shuffled_windows_too_short_stream():
    with pytest.raises(ValueError, match=r"valid split has 10 tokens.*--seq-length 16"):
        ShuffledWindows(np.arange(10), 16, 5, seed=0, split_index=1)
    with pytest.raises(IndexError):
        ShuffledWindows(np.arange(17), 16, 1, seed=0, split_index=0)[1]


# --- embedded ---------------------------------------------------------------------------------


def test_embedded_builds_with_byte_tokenizer():
    docs = load_documents()
    assert len(docs) >= 70
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert n_bytes > 400_000
    splits = build_embedded(EmbeddedTextConfig(), _request(), _ctx(ByteTokenizer()))
    train_docs, valid_docs = split_ranges("969,30,1", len(docs))[:2]
    train_tokens = sum(len(d.encode()) + 1 for d in docs[slice(*train_docs)])
    valid_tokens = sum(len(d.encode()) + 1 for d in docs[slice(*valid_docs)])
    assert splits.train.windows_per_epoch == (train_tokens - 1) // 128 > 3000
    assert splits.valid.windows_per_epoch == (valid_tokens - 1) // 128 >= 16
    assert len(splits.valid) >= 100 and len(splits.train) >= 1000
    assert splits.test is None  # round(.999*79) == 79: no documents
    text = ByteTokenizer().detokenize(splits.train[0]["tokens"].tolist())
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters / len(text) > 0.7
    assert " the " in "".join(
        ByteTokenizer().detokenize(splits.train[i]["tokens"]) for i in range(8)
    )
    assert int(splits.train[5]["tokens"].max()) <= 256


def test_embedded_is_deterministic_and_through_registry():
    spec = make_plugins().datasets.get("embedded")
    assert spec.default_tokenizer == "ByteTokenizer"
    a = spec.build(spec.config_cls(), _request(), _ctx(ByteTokenizer(), seq_length=256))
    b = spec.build(spec.config_cls(), _request(), _ctx(ByteTokenizer(), seq_length=256))
    np.testing.assert_array_equal(a.train[123]["tokens"], b.train[123]["tokens"])
    np.testing.assert_array_equal(a.valid[50]["labels"], b.valid[50]["labels"])
    assert a.valid.windows_per_epoch >= 16


# --- mock -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), NullTokenizer(99)])
def test_mock_samples_are_arithmetic_mod_vocab(tokenizer):
    splits = build_mock(MockDataConfig(), _request("1,1,1", (40, 8, 0)), _ctx(tokenizer, 64))
    assert (len(splits.train), len(splits.valid), splits.test) == (40, 8, None)
    vocab = tokenizer.vocab_size
    for split in (splits.train, splits.valid):
        for i in range(len(split)):
            s = split[i]
            assert s["tokens"].shape == (64,) and s["tokens"].dtype == np.int64
            expected = (s["tokens"][0] + np.arange(65)) % vocab
            np.testing.assert_array_equal(s["tokens"], expected[:-1])
            np.testing.assert_array_equal(s["labels"], expected[1:])
            assert s["loss_mask"].dtype == np.float32 and s["loss_mask"].sum() == 64.0
    starts = {int(splits.train[i]["tokens"][0]) for i in range(40)}
    assert len(starts) > 20  # starts are spread over the vocab, not all equal


def test_mock_determinism_and_zero_width():
    ctx = _ctx(NullTokenizer(1000), 32, seed=5)
    a = build_mock(MockDataConfig(), _request("1,1,1", (10, 10, 10)), ctx)
    b = build_mock(MockDataConfig(), _request("1,1,1", (10, 10, 10)), ctx)
    assert [int(a.train[i]["tokens"][0]) for i in range(10)] == [
        int(b.train[i]["tokens"][0]) for i in range(10)
    ]
    expected = int(np.random.default_rng([5, 1, 3]).integers(1001))
    assert int(a.valid[3]["tokens"][0]) == expected
    c = build_mock(MockDataConfig(), _request("100,0,0", (10, 10, 10)), ctx)
    assert len(c.train) == 10 and c.valid is None and c.test is None
    with pytest.raises(IndexError):
        a.train[10]
