"""``t5``: Megatron's T5 span-corruption dataset over sentence data.

Input: a sentence-level indexed dataset (``mega preprocess --split-sentences``); ``--split`` divides
the documents. Sample ``idx`` of a split is megatron-core's ``T5MaskedWordPieceDataset[idx]`` for
the same data, seed and settings:

- its row of the sample index (:mod:`mega.plugins.datasets.masking`; target ``seq_length - 2``,
  documents need 1 sentence) gives the sentences, concatenated and cut to the target length;
- ``RandomState((seed + idx) % 2**32)`` draws the masking: whole words, span lengths in words
  ``min(geometric(0.2), 10)`` (SpanBERT's distribution, Megatron's choice: a mean of about 4.5
  words before spans shrink to fit the budget; T5's paper used a mean of 3), ``--mask-prob`` of the
  tokens, always replaced, never random;
- each masked span becomes one sentinel (``tokenizer.additional_special_tokens_ids``, from
  ``--vocab-extra-ids``, in order) in the encoder input; the decoder input is
  ``[BOS] + Σ(sentinel + span)`` and the labels ``Σ(sentinel + span) + [EOS]``.

Outputs (numpy int64): ``text_enc`` (``seq_length``, padded with the pad id), ``text_dec`` and
``labels`` (``--decoder-seq-length``; ``text_dec`` padded with the pad id, ``labels`` with -1),
``loss_mask`` (1 on the decoder's tokens), ``enc_mask`` and ``dec_mask`` (1 on tokens, 0 on
padding) and ``truncated`` (an int): megatron-core's keys. Its ``enc_dec_mask`` is built from
``enc_mask`` and ``dec_mask`` at batch time (``T5MaskedWordPieceDataset.config_attention_mask``),
not by the dataset. With a pad id of 0 (WordPiece vocabularies) the arrays equal megatron-core's.

**Without --data-path** (and without ``--train-data-path``, which this dataset refuses) it reads
the embedded corpus instead, with no file and no download: Python's pydoc_data topics (79
documents), each split into sentences as ``mega preprocess --split-sentences`` splits them and
tokenized in memory with the run's tokenizer (:mod:`mega.plugins.datasets.embedded_sentences`).
A run that names no tokenizer then gets ``EmbeddedWordPiece`` (BERT's lower-case WordPiece with a
vocabulary learned from that corpus, and T5's 100 sentinels by default) instead of
``BertWordPieceLowerCase``, which needs ``--vocab-file``. ``--split`` divides the 79 documents.
The sample index skips, as for any data, multi-sentence documents with a sentence over 512
tokens: 5 of the 79 (long tables and listings: operator-summary, strings, string-methods,
typesseq, typesseq-mutable; ~19% of the tokens). It is built in memory each run, never cached
(``--data-cache-path`` is ignored). With the defaults (seq 128, ``--decoder-seq-length`` 128,
``--split 969,30,1``, seed 1234; CPython 3.11's corpus) one epoch is 693 train samples and 8
valid ones; no test split.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from mega import BuildContext, DataRequest, DatasetSpec, DatasetSplits, hookimpl
from mega.plugins.datasets.masked_samples import MaskedWordPieceConfig, MaskedWordPieceSamples
from mega.plugins.datasets.masking import (
    WordPieceVocabulary,
    mask_ngrams,
)
from mega.plugins.datasets.sentence_index import (
    open_split_indices,
    require_tokens,
)
from mega.plugins.datasets.splits import SPLIT_NAMES

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

# --decoder-seq-length is the T5 model's flag (its position table and FLOPs depend on it): the
# dataset reads it from the run's model config, and uses this without one
DEFAULT_DECODER_SEQ_LENGTH = 128
T5_MAX_NGRAM = 10  # pretrain_t5.py: masking_max_ngram=10, full words, geometric span lengths


class T5DatasetConfig(MaskedWordPieceConfig):
    """The t5 dataset's flags: --mask-prob and --short-seq-prob, as BERT's."""


class T5Samples(MaskedWordPieceSamples):
    """One split: ``sample_index`` rows turned into span-corrupted encoder/decoder pairs."""

    def __init__(
        self,
        indexed: Any,
        sample_index: np.ndarray,
        config: T5DatasetConfig,
        vocab: WordPieceVocabulary,
        tokenizer: Any,
        seq_length: int,
        seed: int,
        name: str,
        decoder_seq_length: int = DEFAULT_DECODER_SEQ_LENGTH,
    ) -> None:
        super().__init__(indexed, sample_index, config, vocab, seq_length, seed, name)
        self.decoder_seq_length = int(decoder_seq_length)
        self.bos = int(tokenizer.bos)
        self.eos = int(tokenizer.eos)
        self.sentinels = [int(i) for i in tokenizer.additional_special_tokens_ids]

    def _replacement(self, rng: np.random.RandomState) -> int:
        return self.vocab.mask  # T5 always masks: no random ids, no kept tokens, no draws

    def __getitem__(self, idx: int) -> dict[str, Any]:
        import numpy as np

        idx = int(idx)
        sentences, target, rng = self._row(idx)
        tokens = [t for sentence in sentences for t in sentence]
        truncated = len(tokens) > target
        tokens = tokens[:target]

        _, _, _, spans = mask_ngrams(
            tokens,
            target,
            rng,
            self.vocab,
            mask_prob=self.config.mask_prob,
            max_ngram=T5_MAX_NGRAM,
            geometric=True,
            replacement=self._replacement,
        )
        if len(spans) > len(self.sentinels):
            raise ValueError(
                f"{self.name} sample {idx} masks {len(spans)} spans but the tokenizer has "
                f"{len(self.sentinels)} sentinels: raise --vocab-extra-ids"
            )

        sentinels = deque(self.sentinels)
        encoder: list[int] = []
        decoder = [self.bos]
        labels: list[int] = []
        cursor = 0
        for positions, originals in spans:
            sentinel = sentinels.popleft()
            encoder.extend(tokens[cursor : positions[0]])
            encoder.append(sentinel)
            decoder.append(sentinel)
            decoder.extend(originals)
            labels.append(sentinel)
            labels.extend(originals)
            cursor = positions[-1] + 1
        encoder.extend(tokens[cursor:])
        labels.append(self.eos)

        enc_len, dec_len = self.seq_length, self.decoder_seq_length
        if len(encoder) > enc_len:  # pragma: no cover - the index's target is seq_length - 2
            raise ValueError(f"{self.name} sample {idx}: {len(encoder)} encoder tokens > {enc_len}")
        if len(decoder) > dec_len:
            raise ValueError(
                f"{self.name} sample {idx} needs {len(decoder)} decoder tokens but "
                f"--decoder-seq-length is {dec_len}: raise it or lower --mask-prob"
            )
        pad = self.vocab.pad
        text_enc = np.full(enc_len, pad, dtype=np.int64)
        text_enc[: len(encoder)] = encoder
        text_dec = np.full(dec_len, pad, dtype=np.int64)
        text_dec[: len(decoder)] = decoder
        label_ids = np.full(dec_len, -1, dtype=np.int64)
        label_ids[: len(labels)] = labels
        enc_mask = np.zeros(enc_len, dtype=np.int64)
        enc_mask[: len(encoder)] = 1
        dec_mask = np.zeros(dec_len, dtype=np.int64)
        dec_mask[: len(decoder)] = 1
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": label_ids,
            "loss_mask": dec_mask.copy(),  # one label per decoder input token
            "truncated": int(truncated),
            "enc_mask": enc_mask,
            "dec_mask": dec_mask,
        }


def build_t5(config: T5DatasetConfig, request: DataRequest, ctx: BuildContext) -> DatasetSplits:
    problems = config.validate()
    if problems:
        raise ValueError("; ".join(problems))
    hint = (
        "use --tokenizer-type BertWordPieceLowerCase with --vocab-extra-ids 100 (or, without "
        "--data-path, EmbeddedWordPiece)"
    )
    require_tokens(ctx.tokenizer, ("bos", "eos", "mask"), "t5", hint)
    if not list(getattr(ctx.tokenizer, "additional_special_tokens_ids", None) or []):
        raise ValueError(f"the t5 dataset needs sentinel tokens (none on the tokenizer); {hint}")
    if ctx.seq_length < 3:
        raise ValueError(f"--seq-length {ctx.seq_length} is too short for T5 samples")
    decoder_length = getattr(ctx.model_config, "decoder_seq_length", DEFAULT_DECODER_SEQ_LENGTH)
    if decoder_length < 2:
        raise ValueError(f"--decoder-seq-length must be at least 2, got {decoder_length}")
    vocab = WordPieceVocabulary(ctx.tokenizer)
    indexed, indices = open_split_indices(
        "t5",
        "T5MaskedWordPieceDataset",
        request,
        ctx,
        ctx.seq_length - 2,  # room for the decoder's [BOS] and the labels' [EOS]
        1,
        config.short_seq_prob,
    )
    splits = [
        None
        if index is None
        else T5Samples(
            indexed,
            index,
            config,
            vocab,
            ctx.tokenizer,
            ctx.seq_length,
            ctx.seed,
            f"t5 {SPLIT_NAMES[split]}",
            decoder_length,
        )
        for split, index in enumerate(indices)
    ]
    return DatasetSplits(train=splits[0], valid=splits[1], test=splits[2])


@hookimpl
def register_datasets(register: Any) -> None:
    register(
        DatasetSpec(
            name="t5",
            config_cls=T5DatasetConfig,
            build=build_t5,
            description="Megatron T5 span corruption: sentinels, geometric span lengths, separate "
            "encoder/decoder lengths (sentence-split .bin/.idx; without --data-path, the "
            "embedded corpus).",
            default_tokenizer="BertWordPieceLowerCase",
            offline_tokenizer="EmbeddedWordPiece",
            provides=(
                "text_enc",
                "text_dec",
                "labels",
                "loss_mask",
                "truncated",
                "enc_mask",
                "dec_mask",
            ),
        )
    )
