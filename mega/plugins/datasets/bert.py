"""``bert``: Megatron's BERT dataset (masked LM + next-sentence prediction) over sentence data.

Input: a sentence-level indexed dataset (``mega preprocess --split-sentences``). ``--split``
divides the documents. Sample ``idx`` of a split is megatron-core's
``BERTMaskedWordPieceDataset[idx]`` for the same data, seed and settings:

- its row of the sample index (:mod:`mega.plugins.datasets.masking`; target ``seq_length - 3``,
  documents need 2 sentences with the binary head, else 1) gives sentences and a target length;
- ``RandomState((seed + idx) % 2**32)`` then draws, in order: the A/B split point (random in
  ``[1, n)`` when ``n >= 3`` sentences, else 1) and the swap (p = 0.5, ``is_random = 1``); the
  truncation (one token at a time from the longer segment, front or back with p = 0.5); the
  masking (whole words, n-grams up to 3 with ``P(n) ∝ 1/n``, ``--mask-prob`` of the tokens, each
  masked token 80% ``[MASK]``, 10% a random vocabulary id, 10% unchanged);
- layout ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` without the binary head), types 0 for
  ``[CLS] A [SEP]`` and 1 for ``B [SEP]``.

Outputs (numpy int64 arrays of length ``seq_length``, plus two ints): ``text`` (padded with the
tokenizer's pad id), ``types`` (0 in the padding), ``labels`` (the original id at masked positions,
-1 elsewhere), ``loss_mask`` (1 at masked positions), ``padding_mask`` (1 on tokens, 0 on
padding), ``is_random`` and ``truncated``. With a pad id of 0, as in every WordPiece vocabulary,
these are exactly megatron-core's arrays; Megatron instead fills ``types`` and ``padding_mask``
with the pad id and rewrites pad ids in ``text`` to 0, which differ only for a nonzero pad id.

**Without --data-path** (and without ``--train-data-path``, which this dataset refuses) it reads
the embedded corpus instead, with no file and no download: Python's pydoc_data topics (79
documents), each split into sentences as ``mega preprocess --split-sentences`` splits them and
tokenized in memory with the run's tokenizer (:mod:`mega.plugins.datasets.embedded_sentences`).
A run that names no tokenizer then gets ``EmbeddedWordPiece`` (BERT's lower-case WordPiece with a
vocabulary learned from that corpus) instead of ``BertWordPieceLowerCase``, which needs
``--vocab-file``. ``--split`` divides the 79 documents. The sample index skips documents of one
sentence (with the binary head; none here) and, as for any data, multi-sentence documents with a
sentence over 512 tokens: 5 of the 79 (long tables and listings: operator-summary, strings,
string-methods, typesseq, typesseq-mutable; ~19% of the tokens). It is built in memory each run,
never cached (``--data-cache-path`` is ignored). With the defaults (seq 128, ``--split 969,30,1``,
seed 1234; CPython 3.11's corpus) one epoch is 691 train samples and 8 valid ones; no test split.
"""

from __future__ import annotations

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

BERT_MAX_NGRAM = 3  # pretrain_bert.py: masking_max_ngram=3, full words, 1/n n-gram sizes


class BertDatasetConfig(MaskedWordPieceConfig):
    """The bert dataset's flags: --mask-prob and --short-seq-prob, as T5's."""


class BertSamples(MaskedWordPieceSamples):
    """One split: ``sample_index`` rows turned into masked sentence pairs on demand."""

    def __init__(
        self,
        indexed: Any,
        sample_index: np.ndarray,
        config: BertDatasetConfig,
        vocab: WordPieceVocabulary,
        seq_length: int,
        seed: int,
        name: str,
        binary_head: bool = True,
    ) -> None:
        super().__init__(indexed, sample_index, config, vocab, seq_length, seed, name)
        self.binary_head = binary_head

    def _replacement(self, rng: np.random.RandomState) -> int | None:
        # 80% [MASK]; else half the time a random vocabulary id, half the time unchanged.
        if rng.random() < 0.8:
            return self.vocab.mask
        if rng.random() >= 0.5:
            ids = self.vocab.random_ids
            return int(ids[rng.randint(0, len(ids))])
        return None

    def __getitem__(self, idx: int) -> dict[str, Any]:
        import numpy as np

        idx = int(idx)
        sentences, target, rng = self._row(idx)

        pivot, is_random = len(sentences), False
        if self.binary_head:
            pivot = 1 if len(sentences) < 3 else int(rng.randint(low=1, high=len(sentences)))
            is_random = bool(rng.random() < 0.5)
        seg_a = [t for sentence in sentences[:pivot] for t in sentence]
        seg_b = [t for sentence in sentences[pivot:] for t in sentence]
        if is_random:
            seg_a, seg_b = seg_b, seg_a

        # Trim one token at a time from the longer segment (B on ties), at a random end.
        truncated = len(seg_a) + len(seg_b) > target
        a0, a1, b0, b1 = 0, len(seg_a), 0, len(seg_b)
        while (a1 - a0) + (b1 - b0) > target:
            front = rng.random() < 0.5
            if a1 - a0 > b1 - b0:
                a0, a1 = (a0 + 1, a1) if front else (a0, a1 - 1)
            else:
                b0, b1 = (b0 + 1, b1) if front else (b0, b1 - 1)
        seg_a, seg_b = seg_a[a0:a1], seg_b[b0:b1]

        cls, sep = self.vocab.cls, self.vocab.sep
        tokens = [cls, *seg_a, sep]
        types = [0] * len(tokens)
        if seg_b:
            tokens += [*seg_b, sep]
            types += [1] * (len(seg_b) + 1)

        masked, positions, labels, _ = mask_ngrams(
            tokens,
            target,
            rng,
            self.vocab,
            mask_prob=self.config.mask_prob,
            max_ngram=BERT_MAX_NGRAM,
            geometric=False,
            replacement=self._replacement,
        )

        s, n = self.seq_length, len(masked)
        if n > s:  # pragma: no cover - the index's target is seq_length - 3
            raise ValueError(f"{self.name} sample {idx} has {n} tokens > --seq-length {s}")
        text = np.full(s, self.vocab.pad, dtype=np.int64)
        text[:n] = masked
        type_ids = np.zeros(s, dtype=np.int64)
        type_ids[:n] = types
        padding_mask = np.zeros(s, dtype=np.int64)
        padding_mask[:n] = 1
        label_ids = np.full(s, -1, dtype=np.int64)
        label_ids[positions] = labels
        loss_mask = np.zeros(s, dtype=np.int64)
        loss_mask[positions] = 1
        return {
            "text": text,
            "types": type_ids,
            "labels": label_ids,
            "is_random": int(is_random),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }


def model_binary_head(ctx: BuildContext) -> bool:
    """Whether the run's model has a binary head (``--bert-no-binary-head`` is the BERT model's
    flag, as in Megatron it drops the head and the sentence pairs together); True when the
    model says nothing (no model, or one without the flag)."""
    return bool(getattr(ctx.model_config, "bert_binary_head", True))


def build_bert(config: BertDatasetConfig, request: DataRequest, ctx: BuildContext) -> DatasetSplits:
    problems = config.validate()
    if problems:
        raise ValueError("; ".join(problems))
    require_tokens(
        ctx.tokenizer,
        ("cls", "sep", "mask"),
        "bert",
        "use --tokenizer-type BertWordPieceLowerCase or BertWordPieceCase (or, without "
        "--data-path, EmbeddedWordPiece)",
    )
    if ctx.seq_length < 4:
        raise ValueError(f"--seq-length {ctx.seq_length} is too short for [CLS] A [SEP] B [SEP]")
    vocab = WordPieceVocabulary(ctx.tokenizer)
    binary_head = model_binary_head(ctx)
    min_sentences = 2 if binary_head else 1
    indexed, indices = open_split_indices(
        "bert",
        "BERTMaskedWordPieceDataset",
        request,
        ctx,
        ctx.seq_length - 3,  # [CLS], [SEP], [SEP]
        min_sentences,
        config.short_seq_prob,
    )
    splits = [
        None
        if index is None
        else BertSamples(
            indexed,
            index,
            config,
            vocab,
            ctx.seq_length,
            ctx.seed,
            f"bert {SPLIT_NAMES[split]}",
            binary_head,
        )  # fmt: skip
        for split, index in enumerate(indices)
    ]
    return DatasetSplits(train=splits[0], valid=splits[1], test=splits[2])


@hookimpl
def register_datasets(register: Any) -> None:
    register(
        DatasetSpec(
            name="bert",
            config_cls=BertDatasetConfig,
            build=build_bert,
            description="Megatron BERT: whole-word n-gram masking + NSP sentence pairs "
            "(sentence-split .bin/.idx; without --data-path, the embedded corpus).",
            default_tokenizer="BertWordPieceLowerCase",
            offline_tokenizer="EmbeddedWordPiece",
            provides=(
                "text",
                "types",
                "labels",
                "is_random",
                "padding_mask",
                "loss_mask",
                "truncated",
            ),
        )
    )
