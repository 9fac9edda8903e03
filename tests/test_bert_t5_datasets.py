"""The BERT and T5 datasets: Megatron's sample index, masking, NSP pairs and span corruption.

The corpus is Python's reference manual (pydoc_data), split into sentences and tokenized with a
small WordPiece vocabulary trained here, through mega's ``BertWordPieceLowerCase`` plugin, into a
sentence-level ``.bin/.idx`` (what ``mega preprocess --split-sentences`` writes). megatron-core is
the oracle: its C++ ``build_mapping`` for the sample index, and its ``BERTMaskedWordPieceDataset``
/ ``T5MaskedWordPieceDataset.__getitem__`` for the samples.
"""

from __future__ import annotations

import re
import types
import warnings
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mega import BuildContext, DataRequest
from mega.plugins.datasets.bert import BERT_MAX_NGRAM, BertDatasetConfig, build_bert
from mega.plugins.datasets.indexed import IndexedDataset, IndexedDatasetBuilder
from mega.plugins.datasets.masking import (
    WordPieceVocabulary,
    mask_ngrams,
    word_candidates,
)
from mega.plugins.datasets.sentence_index import (
    MT19937_64,
    build_sample_index,
)
from mega.plugins.datasets.t5 import T5DatasetConfig, build_t5

SENTENCE_END = re.compile(r"(?<=[.!?:])\s+|\n\s*\n")
EXTRA_IDS = 100


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(prefix, tokenizer): 79 documents, ~4,500 sentences, ~130k tokens."""
    from pydoc_data.topics import topics

    from tokenizers import BertWordPieceTokenizer as Trainer

    from mega.plugins.tokenizers.bert_wordpiece import BertWordPieceTokenizer

    folder = tmp_path_factory.mktemp("bert_t5")
    docs = [topics[key] for key in sorted(topics)]
    trainer = Trainer(lowercase=True)
    trainer.train_from_iterator(
        docs,
        vocab_size=2000,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False,
    )
    trainer.save_model(str(folder))
    tokenizer = BertWordPieceTokenizer(str(folder / "vocab.txt"), True, EXTRA_IDS)
    prefix = folder / "corpus_text_sentence"
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    for doc in docs:
        sentences = [s for s in SENTENCE_END.split(doc) if s.strip()]
        builder.add_document([ids for ids in tokenizer.tokenize_batch(sentences) if ids])
    builder.finalize()
    return str(prefix), tokenizer


def context(tokenizer, seq_length=128, seed=1234, **model):
    """``model``: the model config fields the datasets read (bert_binary_head, decoder_seq_length)."""
    return BuildContext(
        seed=seed, device="cpu", params_dtype="float32", seq_length=seq_length, tokenizer=tokenizer,
        model_config=types.SimpleNamespace(**model) if model else None,
    )  # fmt: skip


def request(prefix, num_samples=(1500, 100, 0), split="90,10,0", cache_path=None):
    return DataRequest(
        split=split, data_path=(prefix,), num_samples=num_samples, cache_path=cache_path
    )


def original_tokens(sample):
    """The BERT input before masking: labels put back at the masked positions."""
    text = sample["text"].copy()
    masked = sample["loss_mask"] == 1
    text[masked] = sample["labels"][masked]
    return text[sample["padding_mask"] == 1]


# ---- sample index ---------------------------------------------------------------------------


def test_mt19937_64_is_the_cpp_standard_generator():
    # C++11 [rand.predef]: the 10000th output of a default-constructed mt19937_64.
    assert int(MT19937_64(5489).next(10000)[-1]) == 9981545732273789042


@pytest.mark.parametrize(
    "docs, samples, target, short_prob, seed, min_sentences",
    [
        ((0, 79), 1000, 125, 0.1, 1234, 2),  # BERT with NSP, several epochs
        ((0, 70), 5000, 62, 0.1, 7, 1),  # T5 / BERT without NSP, many epochs
        ((3, 60), 10, 509, 0.0, 1, 1),  # no short sequences: no draws at all
        ((71, 79), 3000, 30, 0.5, 99, 2),  # a late split, short targets half the time
    ],
)
def test_sample_index_equals_megatron_build_mapping(
    corpus, docs, samples, target, short_prob, seed, min_sentences
):
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    data = IndexedDataset(corpus[0])
    bounds = np.array(data.document_indices[docs[0] : docs[1] + 1])
    ours = build_sample_index(
        bounds, data.sequence_lengths, samples, target, short_prob, seed, min_sentences
    )
    epochs = np.iinfo(np.int32).max - 1  # Megatron's "as many as num_samples needs"
    theirs = helpers.build_mapping(
        bounds, data.sequence_lengths, epochs, samples, target, short_prob, seed, False,
        min_sentences,
    )  # fmt: skip
    assert ours.shape == theirs.shape and len(ours) >= samples
    np.testing.assert_array_equal(ours, theirs.astype(np.int64))


def test_sample_index_invariants(corpus):
    """Rows stay inside one eligible document and every epoch covers each of its sentences once."""
    data = IndexedDataset(corpus[0])
    bounds = np.array(data.document_indices)
    target = 125
    rows = build_sample_index(bounds, data.sequence_lengths, 2500, target, 0.1, 5, 2)
    doc_of = np.searchsorted(bounds, rows[:, 0], side="right") - 1
    assert (rows[:, 1] > rows[:, 0]).all()
    assert (rows[:, 1] <= bounds[doc_of + 1]).all()  # never crosses a document end
    assert (rows[:, 1] - rows[:, 0] >= 2).all()  # NSP needs two sentences
    assert ((rows[:, 2] >= 2) & (rows[:, 2] <= target)).all()
    short = rows[:, 2] < target
    assert 0.07 < short.mean() < 0.13  # --short-seq-prob 0.1
    # long-sentence documents are skipped whole; the others are covered once per epoch
    counts = np.zeros(len(data), dtype=np.int64)
    for start, end, _ in rows:
        counts[start:end] += 1
    lengths = np.asarray(data.sequence_lengths)
    epochs = None
    for doc in range(data.num_documents):
        first, last = bounds[doc], bounds[doc + 1]
        covered = set(counts[first:last].tolist())
        if last - first < 2 or lengths[first:last].max() > 512:
            assert covered <= {0}
        else:
            assert len(covered) == 1
            epochs = epochs or covered.pop()
            assert counts[first] == epochs
    assert epochs >= 2 and len(rows) >= 2500
    # shuffled: rows are not in document order
    assert (np.diff(rows[:200, 0]) < 0).any()


# ---- BERT -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_train(corpus):
    prefix, tokenizer = corpus
    splits = build_bert(BertDatasetConfig(), request(prefix), context(tokenizer))
    return splits.train


@pytest.fixture(scope="module")
def bert_samples(bert_train):
    return [bert_train[i] for i in range(1500)]


def test_bert_layout_types_and_lengths(corpus, bert_train, bert_samples):
    _, tok = corpus
    for sample in bert_samples:
        assert sample["text"].shape == (128,) and sample["text"].dtype == np.int64
        tokens = original_tokens(sample)
        n = len(tokens)
        assert n <= 128 and sample["padding_mask"].sum() == n
        seps = np.flatnonzero(tokens == tok.sep)
        assert tokens[0] == tok.cls and len(seps) == 2 and seps[1] == n - 1
        expected_types = np.zeros(128, dtype=np.int64)
        expected_types[seps[0] + 1 : n] = 1
        np.testing.assert_array_equal(sample["types"], expected_types)
        assert (sample["text"][n:] == tok.pad).all()
        assert (sample["labels"][sample["loss_mask"] == 0] == -1).all()
    nsp = np.mean([s["is_random"] for s in bert_samples])
    assert 0.45 < nsp < 0.55
    assert 0 < np.mean([s["truncated"] for s in bert_samples]) < 1


def test_bert_segments_are_the_rows_sentences(corpus, bert_train, bert_samples):
    """A and B are contiguous runs of the row's sentences (swapped when is_random), trimmed."""
    _, tok = corpus
    data = bert_train.indexed
    for idx in range(200):
        sample, (start, end, _) = bert_samples[idx], bert_train.sample_index[idx]
        tokens = original_tokens(sample).tolist()
        sep = tokens.index(tok.sep)
        seg_a, seg_b = tokens[1:sep], tokens[sep + 1 : -1]
        if sample["is_random"]:
            seg_a, seg_b = seg_b, seg_a
        whole = [t for i in range(start, end) for t in data.get(i).tolist()]
        joined = seg_a + seg_b
        if not sample["truncated"]:
            assert joined == whole
        else:  # both segments are substrings of the row, in order
            text = " ".join(map(str, whole))
            assert " ".join(map(str, seg_a)) in text and " ".join(map(str, seg_b)) in text


def test_bert_masking_rate_replacements_and_whole_words(corpus, bert_samples):
    _, tok = corpus
    vocab = WordPieceVocabulary(tok)
    masked = real = as_mask = kept = 0
    for sample in bert_samples:
        loss = sample["loss_mask"] == 1
        masked += loss.sum()
        real += sample["padding_mask"].sum()
        as_mask += (sample["text"][loss] == tok.mask).sum()
        kept += (sample["text"][loss] == sample["labels"][loss]).sum()
        # whole words: every word is masked entirely or not at all
        positions = set(np.flatnonzero(loss).tolist())
        for word in word_candidates(original_tokens(sample).tolist(), vocab):
            assert len(positions.intersection(word)) in (0, len(word))
        specials = np.isin(original_tokens(sample), [tok.cls, tok.sep])
        assert not sample["loss_mask"][: len(specials)][specials].any()
    rate = masked / real  # budget 15% of the tokens, a little less when words do not fit exactly
    assert 0.13 < rate < 0.155
    assert abs(as_mask / masked - 0.8) < 0.02
    assert abs(kept / masked - 0.1) < 0.015  # 10% unchanged (+ random ids that hit the same)
    assert abs((masked - as_mask - kept) / masked - 0.1) < 0.015


def test_ngram_sizes_are_inverse_proportional(corpus):
    """Spans of 1, 2, 3 words with P(n) ∝ 1/n = 6/11, 3/11, 2/11 (before overlaps and budget)."""
    prefix, tok = corpus
    vocab = WordPieceVocabulary(tok)
    data = IndexedDataset(prefix)
    stream = np.concatenate([data.get(i) for i in range(len(data))]).tolist()
    sizes = Counter()
    for k in range(300):
        tokens = stream[k * 400 : k * 400 + 400]
        rng = np.random.RandomState(k)
        _, _, _, spans = mask_ngrams(
            tokens, 400, rng, vocab, mask_prob=0.15, max_ngram=BERT_MAX_NGRAM, geometric=False,
            replacement=lambda r: tok.mask,
        )  # fmt: skip
        for positions, _ in spans:
            words = [w for w in word_candidates(tokens, vocab) if w[0] in positions]
            sizes[len(words)] += 1
    total = sum(sizes.values())
    observed = [sizes[n] / total for n in (1, 2, 3)]
    assert set(sizes) == {1, 2, 3}
    # overlaps with earlier spans reject long n-grams a little more often than short ones
    for got, want in zip(observed, (6 / 11, 3 / 11, 2 / 11), strict=True):
        assert abs(got - want) < 0.05
    assert observed[0] > observed[1] > observed[2]


def test_bert_is_deterministic_and_seeded(corpus, bert_train, bert_samples):
    prefix, tok = corpus
    again = build_bert(BertDatasetConfig(), request(prefix), context(tok)).train
    for idx in (0, 7, 1499):
        for key, value in again[idx].items():
            np.testing.assert_array_equal(value, bert_samples[idx][key])
    assert not np.array_equal(bert_samples[0]["text"], bert_samples[1]["text"])
    other = build_bert(BertDatasetConfig(), request(prefix), context(tok, seed=99)).train
    assert not np.array_equal(other.sample_index, bert_train.sample_index)


def megatron_dataset(cls_name, sample_index, prefix, tokenizer, seed, **config):
    """A megatron-core dataset object around our sample index, without torch.distributed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = pytest.importorskip(f"megatron.core.datasets.{cls_name}")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    dataset_cls = getattr(module, config.pop("class_name"))
    dataset = object.__new__(dataset_cls)
    dataset.config = types.SimpleNamespace(
        random_seed=seed, tokenizer=tokenizer, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False, **config,
    )  # fmt: skip
    dataset.dataset = MegatronIndexed(prefix)
    dataset.sample_index = sample_index
    dataset.token_lookup = list(tokenizer.inv_vocab.keys())
    dataset._pad_token_id = tokenizer.pad
    return dataset


def test_bert_samples_equal_megatron(corpus, bert_train, bert_samples):
    prefix, tok = corpus
    theirs = megatron_dataset(
        "bert_dataset", bert_train.sample_index, prefix, tok, 1234,
        class_name="BERTMaskedWordPieceDataset", sequence_length=128, classification_head=True,
        masking_probability=0.15, masking_max_ngram=3, masking_use_geometric_distribution=False,
    )  # fmt: skip
    for idx in range(0, 1500, 5):
        ours, ref = bert_samples[idx], theirs[idx]
        assert set(ours) == set(ref)
        for key in ours:
            if key == "padding_mask":
                # Megatron marks padding by value (text == pad), so a random replacement that
                # drew [PAD] counts as padding there; mega marks it by position.
                real = ours["text"] != tok.pad
                np.testing.assert_array_equal(ours[key][real], ref[key][real])
            else:
                np.testing.assert_array_equal(ours[key], ref[key], err_msg=f"{idx} {key}")


def test_bert_without_binary_head(corpus):
    prefix, tok = corpus
    context_ = context(tok, bert_binary_head=False)  # the BERT model's --bert-no-binary-head
    train = build_bert(BertDatasetConfig(), request(prefix, (300, 0, 0)), context_).train
    for idx in range(300):
        sample = train[idx]
        tokens = original_tokens(sample)
        assert tokens[0] == tok.cls and tokens[-1] == tok.sep and (tokens == tok.sep).sum() == 1
        assert sample["is_random"] == 0 and not sample["types"].any()


# ---- T5 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5_train(corpus):
    prefix, tokenizer = corpus
    ctx = context(tokenizer, seq_length=256, seed=77, decoder_seq_length=128)
    return build_t5(T5DatasetConfig(), request(prefix), ctx).train


def split_on_sentinels(ids, sentinels):
    """{sentinel: the ids after it up to the next sentinel}."""
    spans, current = {}, None
    for token in ids:
        if token in sentinels:
            current = spans.setdefault(token, [])
        elif current is not None:
            current.append(token)
    return spans


def test_t5_span_corruption_reconstructs_the_text(corpus, t5_train):
    _, tok = corpus
    sentinel_ids = tok.additional_special_tokens_ids
    sentinels = set(sentinel_ids)
    vocab = WordPieceVocabulary(tok)
    data = t5_train.indexed
    span_words, masked_tokens, all_tokens, without_spans = [], 0, 0, 0
    for idx in range(800):
        sample = t5_train[idx]
        start, end, target = t5_train.sample_index[idx]
        original = [t for i in range(start, end) for t in data.get(i).tolist()][:target]
        enc_len, dec_len = int(sample["enc_mask"].sum()), int(sample["dec_mask"].sum())
        encoder = sample["text_enc"][:enc_len].tolist()
        decoder = sample["text_dec"][:dec_len].tolist()
        labels = sample["labels"][:dec_len].tolist()
        used = [t for t in encoder if t in sentinels]
        assert used == sentinel_ids[: len(used)]  # in order, from the first
        without_spans += not used  # a very short sample can have no word that fits the budget
        assert decoder[0] == tok.bos and labels[-1] == tok.eos
        assert decoder[1:] == labels[:-1]  # teacher forcing: labels are the inputs shifted
        assert [t for t in decoder if t in sentinels] == used
        # padding: enc to seq_length, dec and labels to decoder_seq_length
        assert sample["text_enc"].shape == (256,) and sample["text_dec"].shape == (128,)
        assert (sample["text_enc"][enc_len:] == tok.pad).all()
        assert (sample["text_dec"][dec_len:] == tok.pad).all()
        assert (sample["labels"][dec_len:] == -1).all()
        np.testing.assert_array_equal(sample["loss_mask"], sample["dec_mask"])
        # fill the spans back into the encoder input: the original text, exactly
        spans = split_on_sentinels(labels[:-1], sentinels)
        rebuilt = [
            t for token in encoder for t in (spans[token] if token in sentinels else [token])
        ]
        assert rebuilt == original
        row_length = sum(len(data.get(i)) for i in range(start, end))
        assert sample["truncated"] == int(row_length > target)
        # span lengths in words
        position = 0
        starts = {}
        for token in encoder:
            if token in sentinels:
                starts[position] = len(spans[token])
                position += len(spans[token])
            else:
                position += 1
        for word_start, size in starts.items():
            words = [w for w in word_candidates(original, vocab) if w[0] >= word_start]
            covered = [w for w in words if w[-1] < word_start + size]
            span_words.append(len(covered))
        masked_tokens += sum(len(s) for s in spans.values())
        all_tokens += len(original)
    # Megatron (SpanBERT): words per span min(geometric(0.2), 10): mean (1 - 0.8**10) / 0.2 = 4.46,
    # a little less after spans shrink to fit the 15% budget and long spans overlap more often.
    mean_words = np.mean(span_words)
    print(f"T5: {mean_words:.2f} words/span, {masked_tokens / all_tokens:.4f} masked")
    assert without_spans < 0.02 * 800
    assert 3.6 < mean_words < 4.5
    assert 0.13 < masked_tokens / all_tokens < 0.155


def test_t5_samples_equal_megatron(corpus, t5_train):
    prefix, tok = corpus
    theirs = megatron_dataset(
        "t5_dataset", t5_train.sample_index, prefix, tok, 77,
        class_name="T5MaskedWordPieceDataset", sequence_length=256, sequence_length_encoder=256,
        sequence_length_decoder=128, masking_probability=0.15, masking_max_ngram=10,
        masking_use_geometric_distribution=True,
    )  # fmt: skip
    for idx in range(0, 800, 4):
        ours, ref = t5_train[idx], theirs[idx]
        assert set(ours) == set(ref)
        for key in ours:
            np.testing.assert_array_equal(ours[key], ref[key], err_msg=f"{idx} {key}")


def test_t5_decoder_too_short_is_a_clear_error(corpus):
    prefix, tok = corpus
    ctx = context(tok, seq_length=256, decoder_seq_length=8)
    train = build_t5(T5DatasetConfig(), request(prefix, (50, 0, 0)), ctx).train
    with pytest.raises(ValueError, match="--decoder-seq-length is 8"):
        for idx in range(50):
            train[idx]


# ---- build(): splits, errors, cache, fallbacks ----------------------------------------------


def test_splits_and_requests(corpus):
    prefix, tok = corpus
    splits = build_bert(
        BertDatasetConfig(), request(prefix, (100, 20, 5), "80,10,10"), context(tok)
    )
    assert len(splits.train) >= 100 and len(splits.valid) >= 20 and len(splits.test) >= 5
    data = IndexedDataset(prefix)
    bounds = data.document_indices
    # the valid split reads only its documents (round(.8 * 79) = 63 .. round(.9 * 79) = 71)
    rows = splits.valid.sample_index
    assert rows[:, 0].min() >= bounds[63] and rows[:, 1].max() <= bounds[71]
    none = build_bert(BertDatasetConfig(), request(prefix, (100, 0, 5), "100,0,0"), context(tok))
    assert none.valid is None and none.test is None


def test_build_errors(corpus):
    prefix, tok = corpus
    two = replace(request(prefix), data_path=("0.5", prefix, "0.5", prefix))
    with pytest.raises(ValueError, match="one --data-path prefix"):
        build_bert(BertDatasetConfig(), two, context(tok))
    weighted = replace(request(prefix, (10, 0, 0)), data_path=("1.0", prefix))
    assert len(build_bert(BertDatasetConfig(), weighted, context(tok)).train) >= 10

    class NoMask:
        cls, sep, pad, mask, vocab_size = 2, 3, 0, None, 10

    with pytest.raises(ValueError, match="mask"):
        build_bert(BertDatasetConfig(), request(prefix), context(NoMask()))
    with pytest.raises(ValueError, match="sentinel"):
        build_t5(T5DatasetConfig(), request(prefix), context(types.SimpleNamespace(
            bos=1, eos=2, mask=4, pad=0, vocab_size=10, additional_special_tokens_ids=[])))  # fmt: skip
    with pytest.raises(ValueError, match="mask-prob"):
        build_bert(BertDatasetConfig(mask_prob=1.5), request(prefix), context(tok))


def test_sample_index_cache(corpus, tmp_path):
    prefix, tok = corpus
    cached = request(prefix, (200, 0, 0), cache_path=str(tmp_path / "cache"))
    first = build_bert(BertDatasetConfig(), cached, context(tok)).train
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 2 and files[1].endswith("-BERTMaskedWordPieceDataset-sample_index.npy")
    second = build_bert(BertDatasetConfig(), cached, context(tok)).train
    np.testing.assert_array_equal(first.sample_index, second.sample_index)
    build_bert(BertDatasetConfig(short_seq_prob=0.2), cached, context(tok))  # a new key
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 2


def test_tokenizer_without_vocabulary_strings(corpus):
    """No inv_vocab: every token is its own word, random ids come from range(vocab_size)."""
    prefix, tok = corpus
    plain = types.SimpleNamespace(
        cls=tok.cls, sep=tok.sep, mask=tok.mask, pad=tok.pad, vocab_size=tok.vocab_size
    )
    train = build_bert(BertDatasetConfig(), request(prefix, (50, 0, 0)), context(plain)).train
    vocab = WordPieceVocabulary(plain)
    assert list(vocab.random_ids) == list(range(tok.vocab_size))
    sample = train[3]
    tokens = original_tokens(sample).tolist()
    assert all(len(w) == 1 for w in word_candidates(tokens, vocab))
    assert 0 < sample["loss_mask"].sum() <= round(0.15 * len(tokens))


def test_plugins_take_megatron_flags(plugins):
    """The datasets' own flags, parsed as mega train parses them; --bert-no-binary-head and
    --decoder-seq-length are the models' (the datasets read them from the model config)."""
    from mega.core.config.resolve import parse_sections

    bert = parse_sections(["--mask-prob", "0.2"],
                          {"dataset": plugins.datasets.get("bert").config_cls})  # fmt: skip
    assert bert["dataset"] == BertDatasetConfig(mask_prob=0.2)
    t5 = parse_sections(["--short-seq-prob", "0"],
                        {"dataset": plugins.datasets.get("t5").config_cls})  # fmt: skip
    assert t5["dataset"] == T5DatasetConfig(short_seq_prob=0.0)
    for model, flag in (("bert", "--bert-no-binary-head"), ("t5", "--decoder-seq-length")):
        sections = parse_sections([flag, *(["64"] if model == "t5" else [])],
                                  {"model": plugins.models.get(model).config_cls})  # fmt: skip
        assert sections["model"] != plugins.models.get(model).config_cls()
