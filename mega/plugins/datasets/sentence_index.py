"""The sentence-pair sample index the BERT and T5 datasets share (Megatron's build_mapping).

Not a plugin. Both datasets read a *sentence-level* indexed dataset (``mega preprocess
--split-sentences``): each sequence is a sentence, documents group sentences, and ``--split``
divides the documents.

**Sample index** (megatron-core ``helpers.build_mapping``). Rows ``(start_sent, end_sent,
target_len)``, built document by document, epoch after epoch, until the requested count is reached
at an epoch boundary (so the index holds whole epochs, like Megatron's):

- documents with fewer than ``min_sentences`` sentences are skipped, and so are multi-sentence
  documents with a sentence longer than 512 tokens;
- a sample closes at the first sentence where its length reaches the target while more than one
  sentence remains in the document and it holds ``min_sentences``; otherwise at the document end;
- the target is ``max_seq_length`` except when a raw 32-bit draw ``r`` of ``mt19937(seed)``
  satisfies ``r % round(1/short_seq_prob) == 0``: then ``2 + r % (max_seq_length - 1)``. One draw
  opens each document and one follows each sample (when ``short_seq_prob > 0``);
- the rows are shuffled by Fisher-Yates with ``mt19937_64(seed + 1)``: ``j = r % (i + 1)``.

numpy's ``RandomState(seed)`` *is* ``std::mt19937(seed)`` (same ``init_genrand`` seeding, same
stream), and :class:`MT19937_64` below is the 64-bit generator in numpy, so the index equals the C++
one row for row (the tests compare them). It is built in Python, one step per sample, and cached
when a cache directory is given.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import os
from bisect import bisect_left
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - numpy is imported lazily at run time
    import numpy as np

LONG_SENTENCE_LEN = 512  # helpers.cpp: multi-sentence documents with a longer sentence are skipped
INDEX_VERSION = 1  # bump when the sample index algorithm changes: old caches stop matching

_MASK64 = (1 << 64) - 1


class MT19937_64:
    """``std::mt19937_64`` in numpy: one 312-word twist is three vector operations."""

    N, M = 312, 156
    MATRIX_A = 0xB5026F5AA96619E9
    UPPER = 0xFFFFFFFF80000000
    LOWER = 0x7FFFFFFF

    def __init__(self, seed: int) -> None:
        import numpy as np

        state = [int(seed) & _MASK64]
        for i in range(1, self.N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self._state = np.array(state, dtype=np.uint64)
        self._pending = np.empty(0, dtype=np.uint64)  # tempered outputs not yet handed out

    def _twist(self) -> np.ndarray:
        import numpy as np

        mt, n, m = self._state, self.N, self.M
        upper, lower = np.uint64(self.UPPER), np.uint64(self.LOWER)
        one, matrix = np.uint64(1), np.uint64(self.MATRIX_A)

        def mix(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
            x = (hi & upper) | (lo & lower)
            return (x >> one) ^ ((x & one) * matrix)

        # i in [0, n-m): every input is from the previous state.
        head = mt[m:] ^ mix(mt[: n - m], mt[1 : n - m + 1])
        mt[: n - m] = head
        # i in [n-m, n-1): mt[i-(n-m)] was just updated; mt[i], mt[i+1] are still old.
        mt[n - m : n - 1] = mt[: m - 1] ^ mix(mt[n - m : n - 1], mt[n - m + 1 :])
        mt[n - 1] = mt[m - 1] ^ mix(mt[n - 1 :], mt[:1])[0]
        x = mt.copy()
        x ^= (x >> np.uint64(29)) & np.uint64(0x5555555555555555)
        x ^= (x << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        x ^= (x << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        x ^= x >> np.uint64(43)
        return x

    def next(self, count: int) -> np.ndarray:
        """The next ``count`` outputs (uint64)."""
        import numpy as np

        blocks = [self._pending]
        have = len(self._pending)
        while have < count:
            block = self._twist()
            blocks.append(block)
            have += len(block)
        out = np.concatenate(blocks)
        self._pending = out[count:]
        return out[:count]


class TargetLengths:
    """Megatron's ``get_target_sample_len`` over the ``mt19937(seed)`` stream, in chunks.

    ``chunk()`` returns the next targets as a list; with ``short_seq_prob == 0`` C++ draws nothing
    and every target is the maximum.
    """

    CHUNK = 1 << 16

    def __init__(self, seed: int, max_length: int, short_seq_prob: float) -> None:
        import numpy as np

        self.max_length = int(max_length)
        # C's round(): half away from zero (1/p > 0, so floor(x + 0.5)).
        self.ratio = math.floor(1.0 / short_seq_prob + 0.5) if short_seq_prob > 0 else 0
        legacy = np.random.RandomState(int(seed) & 0xFFFFFFFF)  # init_genrand, as std::mt19937
        self._bits = np.random.MT19937()
        self._bits.state = legacy.get_state(legacy=False)

    def chunk(self) -> list[int]:
        import numpy as np

        if self.ratio == 0:
            return [self.max_length] * self.CHUNK
        raw = self._bits.random_raw(self.CHUNK).astype(np.int64)
        short = 2 + raw % (self.max_length - 1)
        return np.where(raw % self.ratio == 0, short, self.max_length).tolist()


def eligible_documents(
    doc_bounds: np.ndarray, sentence_lengths: np.ndarray, min_sentences: int
) -> tuple[list[int], list[int]]:
    """First and last+1 sentence of every document the sample index may use."""
    import numpy as np

    first, last = doc_bounds[:-1], doc_bounds[1:]
    counts = last - first
    long_doc = np.zeros(len(counts), dtype=bool)
    nonempty = counts > 0
    if nonempty.any():
        lengths = np.asarray(sentence_lengths[first[0] : last[-1]], dtype=np.int64)
        longest = np.maximum.reduceat(lengths, (first - first[0])[nonempty])
        long_doc[nonempty] = longest > LONG_SENTENCE_LEN
    keep = (counts >= min_sentences) & ~((counts > 1) & long_doc)
    return first[keep].tolist(), last[keep].tolist()


def build_sample_index(
    doc_bounds: Sequence[int] | np.ndarray,
    sentence_lengths: np.ndarray,
    num_samples: int,
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> np.ndarray:
    """Megatron's ``build_mapping``: shuffled rows ``(start_sent, end_sent, target_len)`` (int64).

    ``doc_bounds`` are the split's document boundaries in sentence indices (``documents + 1``
    entries, as ``document_indices[first_doc : last_doc + 1]``); sentence indices are global.
    Whole epochs are built until at least ``max(num_samples, 1)`` rows exist.
    """
    import numpy as np

    if max_seq_length < 2:
        raise ValueError(f"the target sample length must be at least 2, got {max_seq_length}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")
    bounds = np.asarray(doc_bounds, dtype=np.int64)
    firsts, lasts = eligible_documents(bounds, sentence_lengths, min_sentences)
    if not firsts:
        raise ValueError(
            f"no document has {min_sentences} or more sentences (and none longer than "
            f"{LONG_SENTENCE_LEN} tokens): a BERT/T5 corpus must be sentence-split "
            "(mega preprocess --split-sentences)"
        )
    base, stop = int(bounds[0]), int(bounds[-1])
    # running token counts, indexed by sentence - base; array.array: compact, fast to bisect
    cumulative = np.zeros(stop - base + 1, dtype=np.int64)
    np.cumsum(sentence_lengths[base:stop], out=cumulative[1:])
    cum = array.array("q", cumulative.tobytes())
    del cumulative
    firsts = [f - base for f in firsts]
    lasts = [last - base for last in lasts]

    generator = TargetLengths(seed, max_seq_length, short_seq_prob)
    targets, position = generator.chunk(), 0
    rows = array.array("q")  # (start, end, target) flattened, sentence indices relative to base
    extend = rows.extend
    wanted = 3 * max(int(num_samples), 1)
    spare = min_sentences - 1
    while len(rows) < wanted:
        before = len(rows)
        # One pass over the documents; the hot loop, so everything is a local.
        for first, last in zip(firsts, lasts, strict=True):
            if position == len(targets):
                targets, position = generator.chunk(), 0
            target = targets[position]
            position += 1
            start = first
            while start < last:
                # first sentence whose running length reaches the target, that also holds
                # min_sentences and leaves more than one sentence; otherwise the document's end
                close = bisect_left(cum, cum[start] + target, start + 1, last + 1) - 1
                if close < start + spare:
                    close = start + spare
                if close > last - 3:
                    close = last - 1
                extend((start, close + 1, target))
                start = close + 1
                if position == len(targets):
                    targets, position = generator.chunk(), 0
                target = targets[position]
                position += 1
        if len(rows) == before:  # pragma: no cover - eligible documents always give samples
            raise ValueError("an epoch produced no samples")

    table = np.frombuffer(rows, dtype=np.int64).reshape(-1, 3)
    order = shuffle_order(len(table), seed + 1)
    shuffled = table[np.frombuffer(order, dtype=np.int64)]
    shuffled[:, :2] += base
    return shuffled


def shuffle_order(count: int, seed: int) -> array.array:
    """The permutation C++'s Fisher-Yates with ``mt19937_64(seed)`` applies to ``count`` rows."""
    import numpy as np

    order = array.array("q", range(count))
    generator = MT19937_64(seed % (1 << 64))
    chunk = 1 << 20
    i = count - 1
    while i > 0:
        take = min(chunk, i)
        draws = generator.next(take)
        bounds = np.arange(i + 1, i + 1 - take, -1, dtype=np.uint64)  # i+1, i, ... per step
        swaps = (draws % bounds).tolist()
        for k, j in zip(range(i, i - take, -1), swaps, strict=True):
            order[k], order[j] = order[j], order[k]
        i -= take
    return order


def cached_sample_index(
    cache_dir: str | None, description: dict[str, Any], build: Callable[[], np.ndarray]
) -> np.ndarray:
    """``build()``, stored as ``{md5}-sample_index.npy`` under ``cache_dir`` when one is given.

    The key hashes ``description`` (everything the index depends on). The file is written under a
    temporary name and renamed, so a reader never sees a half-written index.
    """
    import numpy as np

    if not cache_dir:
        return build()
    text = json.dumps(description, sort_keys=True)
    digest = hashlib.md5(text.encode("utf-8")).hexdigest()
    folder = Path(cache_dir)
    path = folder / f"{digest}-{description['class']}-sample_index.npy"
    if path.is_file():
        return np.load(path, mmap_mode="r")
    index = build()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{digest}-{description['class']}-description.json").write_text(text)
    temporary = folder / f".{path.name}.tmp-{os.getpid()}"
    with open(temporary, "wb") as f:
        np.save(f, index)
    os.replace(temporary, path)
    return index


def single_prefix(data_path: Sequence[str], dataset: str) -> str:
    """The one prefix of ``--data-path`` (``PREFIX`` or ``WEIGHT PREFIX``); blends are refused."""
    paths = list(data_path)
    if len(paths) == 2:
        try:
            float(paths[0])
            paths = paths[1:]
        except ValueError:
            pass
    if len(paths) != 1:
        raise ValueError(
            f"the {dataset} dataset reads one --data-path prefix; got {' '.join(data_path) or '[]'}"
            " (blends of several prefixes are not supported for BERT/T5: merge them first with "
            "mega merge-datasets)"
        )
    return paths[0]


def index_description(
    name: str, prefix: str, doc_range: tuple[int, int], **settings: Any
) -> dict[str, Any]:
    """What a cached sample index depends on: the data files, the documents and the settings."""
    idx = Path(f"{prefix}.idx")
    stat = idx.stat()
    return {
        "class": name,
        "version": INDEX_VERSION,
        "prefix": str(idx.resolve()),
        "idx_bytes": stat.st_size,
        "idx_mtime_ns": stat.st_mtime_ns,
        "documents": list(doc_range),
        **settings,
    }


def require_tokens(tokenizer: Any, names: tuple[str, ...], dataset: str, hint: str) -> None:
    if tokenizer is None:
        raise ValueError(f"the {dataset} dataset needs a tokenizer (ctx.tokenizer is None)")
    missing = [name for name in names if getattr(tokenizer, name, None) is None]
    if missing:
        raise ValueError(
            f"the {dataset} dataset needs the tokenizer's {', '.join(missing)} token(s), which "
            f"{type(tokenizer).__name__} lacks; {hint}"
        )


def open_split_indices(
    dataset: str,
    index_class: str,
    request: Any,
    ctx: Any,
    target_length: int,
    min_sentences: int,
    short_seq_prob: float,
) -> tuple[Any, list[np.ndarray | None]]:
    """The indexed dataset and, per split, its sample index (``None``: split not built).

    ``dataset`` names the plugin in messages; ``index_class`` (megatron-core's class name) names
    the cache files, as Megatron's ``{md5}-{Class}-sample_index.npy``.

    With no ``--data-path`` the dataset is the embedded corpus, split into sentences and tokenized
    with ``ctx.tokenizer`` in memory (:mod:`mega.plugins.datasets.embedded_sentences`); its sample
    indices are built every time, never cached (a cache key would need the tokenizer's identity).
    """
    from mega.plugins.datasets.indexed import IndexedDataset
    from mega.plugins.datasets.splits import SPLIT_NAMES, split_ranges

    if request.split_paths is not None:
        raise ValueError(
            f"the {dataset} dataset reads one --data-path prefix divided by --split (or, without "
            "--data-path, the embedded corpus); --train-data-path/--valid-data-path/"
            "--test-data-path are read by the gpt dataset only"
        )
    if request.data_path:
        prefix = single_prefix(request.data_path, dataset)
        indexed = IndexedDataset(prefix)
        cache_path = request.cache_path
    else:
        from mega.plugins.datasets.embedded_sentences import embedded_sentences

        indexed = embedded_sentences(ctx.tokenizer)
        prefix, cache_path = indexed.prefix, None
    ranges = split_ranges(request.split, indexed.num_documents)
    if ranges[0] is None:
        raise ValueError(f"--split {request.split!r} leaves no documents for the train split")
    indices: list[np.ndarray | None] = []
    for split, doc_range in enumerate(ranges):
        wanted = int(request.num_samples[split])
        if doc_range is None or (split > 0 and wanted <= 0):
            indices.append(None)
            continue
        lo, hi = doc_range
        bounds = indexed.document_indices[lo : hi + 1]
        settings = dict(
            num_samples=wanted,
            target_length=target_length,
            short_seq_prob=short_seq_prob,
            seed=ctx.seed,
            min_sentences=min_sentences,
        )
        description = (
            index_description(index_class, prefix, doc_range, **settings) if cache_path else {}
        )

        def build(bounds: Any = bounds, wanted: int = wanted) -> np.ndarray:
            return build_sample_index(
                bounds,
                indexed.sequence_lengths,
                wanted,
                target_length,
                short_seq_prob,
                ctx.seed,
                min_sentences,
            )

        try:
            indices.append(cached_sample_index(cache_path, description, build))
        except ValueError as exc:
            raise ValueError(f"{SPLIT_NAMES[split]} split of {prefix}: {exc}") from None
    return indexed, indices
