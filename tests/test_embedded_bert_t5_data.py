"""BERT and T5 with no data and no download: the ``EmbeddedWordPiece`` tokenizer (a WordPiece
vocabulary learned from the embedded corpus) and the ``bert``/``t5`` datasets without
``--data-path`` (the embedded corpus split into sentences in memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mega import BuildContext, DataRequest
from mega.core.plugins.manager import make_plugins
from mega.plugins.datasets.embedded_text import load_documents
from mega.plugins.tokenizers import embedded_wordpiece
from mega.plugins.tokenizers.embedded_wordpiece import (
    BERT_SPECIALS,
    EmbeddedWordPieceConfig,
    learn_vocabulary,
)

SEQ = 128
SPLIT = "969,30,1"  # Megatron's default: the valid split is the last two topics, no test split


@pytest.fixture(scope="module")
def registry():
    return make_plugins()


@pytest.fixture(scope="module")
def tokenizer(registry, tmp_path_factory):
    """The tokenizer as the engine builds it, cached under a private XDG_CACHE_HOME."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        spec = registry.tokenizers.get("EmbeddedWordPiece")
        yield spec.build(spec.config_cls())


def context(tok, seed=1234):
    return BuildContext(
        seed=seed, device="cpu", params_dtype="float32", seq_length=SEQ, tokenizer=tok
    )


def embedded_request(num_samples=(64, 8, 0), **changes):
    return replace(DataRequest(split=SPLIT, data_path=(), num_samples=num_samples), **changes)


def build(registry, name, tok, request=None, **config):
    spec = registry.datasets.get(name)
    return spec.build(spec.config_cls(**config), request or embedded_request(), context(tok))


# ---- the tokenizer -------------------------------------------------------------------------

LEARN = """
import hashlib, json, sys
from mega.plugins.tokenizers.embedded_wordpiece import EmbeddedWordPieceTokenizer, cache_dir
tok = EmbeddedWordPieceTokenizer()
files = sorted(p.name for p in (cache_dir() / "embedded_wordpiece").iterdir())
print(json.dumps([tok.unique_identifiers["vocab_sha256"], files]))
"""


def test_vocabulary_is_the_same_in_every_process_and_thread_count(tokenizer, tmp_path):
    """Left alone the library's trainer learns a different vocabulary in each process; the
    learned one here is the same for 1 and 2 Rayon threads, each learning it cold."""
    runs = []
    for threads in ("1", "2"):
        env = {**os.environ, "RAYON_NUM_THREADS": threads}
        env["XDG_CACHE_HOME"] = str(tmp_path / f"cache{threads}")  # empty: learned, not read
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", LEARN], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    results = []
    for run in runs:
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0
        results.append(json.loads(out))
    assert results[0] == results[1]
    digest, files = results[0]
    assert digest == tokenizer.unique_identifiers["vocab_sha256"]
    assert len(files) == 1 and files[0].endswith("-vocab.txt")  # the temporary file is gone


def test_specials_sentinels_and_sizes(tokenizer):
    tok = tokenizer
    assert EmbeddedWordPieceConfig().vocab_extra_ids == 100
    assert [tok.pad, tok.unk, tok.cls, tok.sep, tok.mask] == [0, 1, 2, 3, 4]
    assert list(tok.vocab)[:5] == list(BERT_SPECIALS)
    assert (tok.bos, tok.eos, tok.eod) == (4096, 4097, 4097)  # appended after the 4096 lines
    assert tok.inv_vocab[tok.bos] == "[BOS]" and tok.inv_vocab[tok.eos] == "[EOS]"
    assert tok.additional_special_tokens == [f"<extra_id_{i}>" for i in range(100)]
    assert tok.additional_special_tokens_ids == list(range(4098, 4198))
    assert tok.vocab_size == 4198 == len(tok.inv_vocab)
    assert all(tok.inv_vocab[i] == t for t, i in tok.vocab.items())


def test_common_words_are_whole_tokens_and_round_trip(tokenizer):
    text = "the function returns a new list of objects, and raises an exception."
    ids = tokenizer.tokenize(text)
    assert [tokenizer.inv_vocab[i] for i in ids][:9] == [*text.split()[:7], "objects", ","]
    assert tokenizer.detokenize(ids) == text
    upper = "The Interpreter evaluates each Expression."  # lowercased, like BertWordPieceLowerCase
    assert tokenizer.detokenize(tokenizer.tokenize(upper)) == upper.lower()
    rare = tokenizer.tokenize("photosynthesis")  # not in the corpus: WordPiece pieces, not [UNK]
    assert len(rare) > 1 and tokenizer.unk not in rare
    assert tokenizer.detokenize(rare) == "photosynthesis"


def test_vocabulary_cache_file_and_memo(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(embedded_wordpiece, "_memo", {})
    lines, path = embedded_wordpiece.embedded_vocabulary(4096)
    assert path.parent == tmp_path / "mega" / "embedded_wordpiece"
    assert path.read_text().splitlines() == lines == list(tokenizer.vocab)[:4096]
    path.write_text("[PAD]\n")  # a damaged cache file is learned again, and rewritten
    monkeypatch.setattr(embedded_wordpiece, "_memo", {})
    assert embedded_wordpiece.embedded_vocabulary(4096)[0] == lines
    assert path.read_text().splitlines() == lines
    path.unlink()  # memoised in the process: no file needed any more
    assert embedded_wordpiece.embedded_vocabulary(4096)[0] == lines and not path.exists()
    (tmp_path / "file").touch()  # a cache that cannot be written costs only the relearning
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.setattr(embedded_wordpiece, "_memo", {})
    assert embedded_wordpiece.embedded_vocabulary(4096)[0] == lines


def test_flags_and_a_smaller_vocabulary(registry):
    from mega.core.config.resolve import parse_sections

    spec = registry.tokenizers.get("EmbeddedWordPiece")
    parsed = parse_sections(
        ["--wordpiece-vocab-size", "1000", "--vocab-extra-ids", "0"],
        {"tokenizer": spec.config_cls},
    )["tokenizer"]
    assert parsed == EmbeddedWordPieceConfig(wordpiece_vocab_size=1000, vocab_extra_ids=0)
    docs = load_documents()
    small = learn_vocabulary(docs, 1000)
    assert len(small) == 1000 and learn_vocabulary(docs, 1000) == small
    assert "EmbeddedWordPiece" in registry.tokenizers.names()
    assert "no download" in spec.description
    assert EmbeddedWordPieceConfig(wordpiece_vocab_size=10, vocab_extra_ids=-1).validate()


# ---- the datasets without --data-path ------------------------------------------------------


@pytest.fixture(scope="module")
def bert(registry, tokenizer):
    return build(registry, "bert", tokenizer)


@pytest.fixture(scope="module")
def t5(registry, tokenizer):
    return build(registry, "t5", tokenizer)


def test_bert_samples(registry, tokenizer, bert):
    tok = tokenizer
    assert len(bert.train) == 691 and len(bert.valid) == 8 and bert.test is None  # one epoch
    keys = set(registry.datasets.get("bert").provides)
    for split in (bert.train, bert.valid):
        for idx in range(0, len(split), max(1, len(split) // 40)):
            sample = split[idx]
            assert set(sample) == keys
            for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
                assert sample[key].shape == (SEQ,) and sample[key].dtype == np.int64
            masked = sample["loss_mask"] == 1
            assert masked.any() and ((sample["labels"] != -1) == masked).all()
            labels = sample["labels"][masked]
            # masked positions hold real corpus tokens: no special, appended or sentinel id
            assert (labels < tok.bos).all() and not set(labels) & {0, 1, 2, 3, 4}
            text = sample["text"][sample["padding_mask"] == 1]
            assert text[0] == tok.cls and text[-1] == tok.sep
            assert (sample["text"][sample["padding_mask"] == 0] == tok.pad).all()


def test_t5_samples(registry, tokenizer, t5):
    tok = tokenizer
    assert len(t5.train) == 693 and len(t5.valid) == 8 and t5.test is None
    assert registry.models.get("t5").config_cls().decoder_seq_length == SEQ  # the model's flag
    keys = set(registry.datasets.get("t5").provides)
    sentinels = set(tok.additional_special_tokens_ids)
    for split in (t5.train, t5.valid):
        for idx in range(0, len(split), max(1, len(split) // 40)):
            sample = split[idx]
            assert set(sample) == keys
            for key in ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"):
                assert sample[key].shape == (SEQ,) and sample[key].dtype == np.int64
            n = int(sample["dec_mask"].sum())
            labels = sample["labels"][:n]
            assert (sample["labels"][n:] == -1).all() and (
                sample["loss_mask"] == sample["dec_mask"]
            ).all()
            assert sample["text_dec"][0] == tok.bos and labels[-1] == tok.eos
            assert (sample["text_dec"][1:n] == labels[:-1]).all()  # teacher forcing
            spans = [i for i in labels if i in sentinels]
            encoder = sample["text_enc"][sample["enc_mask"] == 1]
            assert spans and spans == [i for i in encoder if i in sentinels]
            words = [i for i in labels[:-1] if i not in sentinels]
            assert words and max(words) < tok.bos and not set(words) & {0, 1, 2, 3, 4}


def test_samples_are_the_same_every_time(registry, tokenizer, bert, t5):
    again_bert = build(registry, "bert", tokenizer)
    again_t5 = build(registry, "t5", tokenizer)
    for first, second in ((bert, again_bert), (t5, again_t5)):
        np.testing.assert_array_equal(first.train.sample_index, second.train.sample_index)
        for idx in (0, 5, len(first.train) - 1):
            a, b, c = first.train[idx], second.train[idx], first.train[idx]
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
                np.testing.assert_array_equal(a[key], c[key])


def test_split_divides_the_documents_and_nothing_is_cached(registry, tokenizer, bert, tmp_path):
    indexed = bert.train.indexed
    assert indexed.num_documents == len(load_documents()) == 79
    bounds = indexed.document_indices
    # --split 969,30,1 of 79 documents: train 0..77, valid 77..79 (round(.969*79) = 77)
    assert bert.train.sample_index[:, 1].max() <= bounds[77]
    rows = bert.valid.sample_index
    assert rows[:, 0].min() >= bounds[77] and rows[:, 1].max() <= bounds[79]
    for i in range(0, len(indexed), 97):  # sentences are read-only views of their tokens
        assert len(indexed[i]) == indexed.sequence_lengths[i] > 0
    cached = embedded_request(cache_path=str(tmp_path / "cache"))
    build(registry, "bert", tokenizer, cached)
    assert not (tmp_path / "cache").exists()


def test_what_still_makes_no_sense_is_a_clear_error(registry, tokenizer):
    per_split = embedded_request(split_paths=(("a",), (), ()))
    with pytest.raises(ValueError, match="gpt dataset only"):
        build(registry, "t5", tokenizer, per_split)
    byte = registry.tokenizers.get("ByteTokenizer")
    byte_tok = byte.build(byte.config_cls())
    with pytest.raises(ValueError, match="EmbeddedWordPiece"):
        build(registry, "bert", byte_tok)
    for name in ("bert", "t5"):
        assert registry.datasets.get(name).offline_tokenizer == "EmbeddedWordPiece"
