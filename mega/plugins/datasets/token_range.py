"""The largest token id of a ``.bin/.idx`` dataset, checked against the tokenizer before training.

Data tokenized with a larger vocabulary than the run's tokenizer (a GPT2BPE corpus trained with
``--tokenizer-type ByteTokenizer``) would otherwise fail deep inside the embedding lookup. One
pass over the ``.bin`` (a memory-mapped ``max``, about 1 GB/s) finds the largest id; it is kept
in a small JSON file in the dataset cache directory, keyed by the ``.idx`` file's fingerprint, so
later runs read it in microseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CHUNK_TOKENS = 1 << 26  # tokens per max() over the memory map (bounded temporary memory)


def largest_token_id(prefix: str, cache_dir: str | Path | None = None) -> int:
    """The largest token id in ``prefix.bin`` (-1 when it holds no tokens)."""
    import numpy as np

    from mega.plugins.datasets.gpt.cache import cache_key, idx_fingerprint
    from mega.plugins.datasets.indexed import IndexedDataset, idx_path

    key = cache_key({"largest_token_id": idx_fingerprint(idx_path(prefix))})
    cached = Path(cache_dir) / f"largest_token_id-{key}.json" if cache_dir else None
    if cached is not None and cached.is_file():
        try:
            return int(json.loads(cached.read_text())["largest_token_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # rewritten below
    data = IndexedDataset(prefix)
    total = data.num_tokens
    largest = -1
    if total:
        tokens = np.frombuffer(data._buffer, data.dtype, total, 0)
        for start in range(0, total, CHUNK_TOKENS):
            largest = max(largest, int(tokens[start : start + CHUNK_TOKENS].max()))
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"prefix": str(prefix), "largest_token_id": largest}))
            os.replace(tmp, cached)
        except OSError:
            pass  # a read-only data directory: recomputed next time
    return largest


def vocabulary_problems(
    prefixes: list[str],
    tokenizer: Any,
    tokenizer_name: str,
    cache_dir: str | None,
    flag: str = "--data-path",
) -> list[str]:
    """One message per dataset (given as ``flag``) whose ids do not fit ``tokenizer``'s
    vocabulary."""
    vocab = int(tokenizer.vocab_size)
    problems = []
    for prefix in prefixes:
        largest = largest_token_id(prefix, cache_dir)
        if largest >= vocab:
            problems.append(
                f"{flag} {prefix} holds token id {largest}, but tokenizer {tokenizer_name}"
                f" has {vocab} ids (0..{vocab - 1}): the data was tokenized with a larger"
                " vocabulary; use the tokenizer it was preprocessed with"
            )
    return problems
