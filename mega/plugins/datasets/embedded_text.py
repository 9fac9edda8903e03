"""``embedded``: a small real-English corpus that ships with Python, for demos and tests.

The documents are the Python reference manual's topics in ``pydoc_data.topics.topics`` (79 topics,
about 466 KB of UTF-8 in CPython 3.11), in sorted key order. The ``--split`` string divides the
*documents* (Megatron's ``round(lo*N)..round(hi*N)``); each split's documents are tokenized, each
followed by EOD, concatenated, and cut into shuffled windows of ``--seq-length + 1`` tokens.

With Megatron's default ``--split 969,30,1`` the valid split gets the last two topics ("with",
"yield"; 4,102 bytes): 32 windows at seq 128, 16 at seq 256 (ByteTokenizer), repeated as epochs to
reach the requested count. The test split rounds to no documents and is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega import BuildContext, DataRequest, DatasetSpec, DatasetSplits, hookimpl
from mega.plugins.datasets.splits import SPLIT_NAMES, ShuffledWindows, split_ranges


@dataclass(kw_only=True)
class EmbeddedTextConfig:
    """No options: the corpus is fixed by the Python installation."""


def load_documents() -> list[str]:
    """The topic texts in sorted key order (a stable document order for the split)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def build_embedded(
    config: EmbeddedTextConfig, request: DataRequest, ctx: BuildContext
) -> DatasetSplits:
    import numpy as np

    if ctx.tokenizer is None:
        raise ValueError("the embedded dataset needs a tokenizer (ctx.tokenizer is None)")
    docs = load_documents()
    ranges = split_ranges(request.split, len(docs))
    if ranges[0] is None:
        raise ValueError(f"--split {request.split!r} leaves no documents for the train split")
    eod = ctx.tokenizer.eod
    splits: list[ShuffledWindows | None] = []
    for index, doc_range in enumerate(ranges):
        # Train always exists; valid/test are skipped when empty or when nobody asked for samples.
        if doc_range is None or (index > 0 and request.num_samples[index] <= 0):
            splits.append(None)
            continue
        ids: list[int] = []
        for doc in docs[doc_range[0] : doc_range[1]]:
            ids.extend(ctx.tokenizer.tokenize(doc))
            ids.append(eod)
        stream = np.asarray(ids, dtype=np.int64)
        splits.append(
            ShuffledWindows(
                stream,
                ctx.seq_length,
                request.num_samples[index],
                ctx.seed,
                index,
                name=f"embedded {SPLIT_NAMES[index]}",
            )
        )
    return DatasetSplits(train=splits[0], valid=splits[1], test=splits[2])


@hookimpl
def register_datasets(register: Any) -> None:
    register(
        DatasetSpec(
            name="embedded",
            config_cls=EmbeddedTextConfig,
            build=build_embedded,
            description="Python's reference docs (pydoc_data, ~466 KB English); no download.",
            default_tokenizer="ByteTokenizer",
        )
    )
