"""The embedded corpus as a sentence-level dataset in memory, for BERT and T5 without ``--data-path``.

Not a plugin. :class:`EmbeddedSentences` is what ``mega preprocess --split-sentences`` would write
for the embedded corpus (:func:`mega.plugins.datasets.embedded_text.load_documents`: Python's
pydoc_data topics, one document each, in sorted key order), held in memory with the part of
:class:`~mega.plugins.datasets.indexed.IndexedDataset`'s interface the sentence datasets use
(``sequence_lengths``, ``document_indices``, ``num_documents``, ``get``, ``[i]``, ``document``):

- each document is cut into sentences by preprocess's splitter
  (:func:`~mega.plugins.datasets.preprocess.splitter.split_sentences`, newlines not kept);
- each sentence is tokenized with the run's tokenizer (no EOD appended: preprocess without
  ``--append-eod``); sentences with no tokens are dropped, as preprocess drops them, and a
  document left with none stays, empty, so ``--split`` divides the same 79 documents as the
  ``embedded`` dataset's.

Building it takes a fraction of a second; nothing is written to disk.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mega.plugins.datasets.embedded_text import load_documents
from mega.plugins.datasets.preprocess.splitter import split_sentences

NAME = "the embedded corpus"  # how messages name it, where a file dataset shows its prefix


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    batch = getattr(tokenizer, "tokenize_batch", None)
    if batch is not None:
        return [list(ids) for ids in batch(texts)] if texts else []
    return [list(tokenizer.tokenize(text)) for text in texts]


class EmbeddedSentences:
    """The embedded corpus's sentences, tokenized: one sequence per sentence, grouped in documents."""

    prefix = NAME

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("the embedded sentences need a tokenizer (ctx.tokenizer is None)")
        docs = load_documents()
        sentences = [split_sentences(doc) for doc in docs]
        ids = _tokenize(tokenizer, [s for doc in sentences for s in doc])
        lengths: list[int] = []
        doc_ends: list[int] = [0]
        position = 0
        for doc in sentences:
            for sentence in ids[position : position + len(doc)]:
                if sentence:
                    lengths.append(len(sentence))
            position += len(doc)
            doc_ends.append(len(lengths))
        flat = [t for sentence in ids for t in sentence]
        self.dtype = np.dtype(np.int32)
        self._tokens = np.asarray(flat, dtype=self.dtype)
        self.sequence_lengths = np.asarray(lengths, dtype=np.int32)
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=starts[1:])
        self._starts = starts
        self.document_indices = np.asarray(doc_ends, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._starts[-1])

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sentence ``index`` (a read-only view)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {index} has {size} tokens; asked {offset}+{length}")
        start = int(self._starts[index]) + offset
        view = self._tokens[start : start + length]
        view.flags.writeable = False
        return view

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document(self, doc: int) -> list[np.ndarray]:
        """The sentences of document ``doc``."""
        first, last = self.document_indices[doc], self.document_indices[doc + 1]
        return [self.get(i) for i in range(first, last)]
