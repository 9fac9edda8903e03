"""The embedded corpus as a sentence-level dataset in memory, for BERT and T5 without ``--data-path``.

Not a plugin. :func:`embedded_sentences` is what ``mega preprocess --split-sentences`` would write
for the embedded corpus (:func:`mega.plugins.datasets.embedded_text.load_documents`: Python's
pydoc_data topics, one document each, in sorted key order), as an in-memory
:class:`~mega.plugins.datasets.indexed.IndexedDataset` (``IndexedDataset.in_memory``):

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
from mega.plugins.datasets.indexed import IndexedDataset
from mega.plugins.datasets.preprocess.encode import tokenize_texts
from mega.plugins.datasets.preprocess.splitter import split_sentences

NAME = "the embedded corpus"  # how messages name it, where a file dataset shows its prefix


def embedded_sentences(tokenizer: Any) -> IndexedDataset:
    """The embedded corpus's sentences, tokenized: one sequence per sentence, grouped in documents."""
    if tokenizer is None:
        raise ValueError("the embedded sentences need a tokenizer (ctx.tokenizer is None)")
    sentences = [split_sentences(doc) for doc in load_documents()]
    ids = iter(tokenize_texts(tokenizer, [s for doc in sentences for s in doc]))
    documents = [[tokens for tokens in (next(ids) for _ in doc) if tokens] for doc in sentences]
    return IndexedDataset.in_memory(documents, np.int32, name=NAME)
