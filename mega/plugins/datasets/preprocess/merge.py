"""Concatenate finished ``.bin/.idx`` datasets into one (Megatron's ``tools/merge_datasets.py``).

Each input is appended with ``IndexedDatasetBuilder.add_index``: its ``.bin`` is byte-copied and
its index shifted, so merging the datasets of A and B equals preprocessing A's lines followed by
B's. Every input must have the same token dtype. The output appears only when complete.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from mega.errors import MegaUsageError
from mega.plugins.datasets.indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError


@dataclass
class MergeResult:
    prefixes: list[str]
    output: str
    dtype: str
    sequences: int
    documents: int
    tokens: int
    seconds: float


def expand_prefixes(inputs: list[str]) -> list[str]:
    """Dataset prefixes from ``--input`` values: a prefix (``x``, ``x.bin`` or ``x.idx`` name the
    same pair), or a directory meaning every pair in it, sorted (as Megatron's tool reads it)."""
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, name[: -len(".idx")])
                for name in os.listdir(item)
                if name.endswith(".idx") and os.path.isfile(os.path.join(item, name))
            )
            if not found:
                raise MegaUsageError(f"--input {item}: directory holds no .bin/.idx datasets")
            prefixes.extend(found)
            continue
        prefix = item[:-4] if item.endswith((".bin", ".idx")) else item
        missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not os.path.isfile(p)]
        if missing:
            raise MegaUsageError(f"--input {item}: no such dataset ({', '.join(missing)} missing)")
        prefixes.append(prefix)
    return prefixes


def merge_datasets(inputs: list[str], output_prefix: str) -> MergeResult:
    """Write ``output_prefix.bin/.idx``, the concatenation of the ``inputs`` datasets in order."""
    start = time.perf_counter()
    prefixes = expand_prefixes(inputs)
    dtypes = {}
    for prefix in prefixes:
        try:
            dtypes[prefix] = IndexedDataset(prefix).dtype
        except IndexedDatasetError as exc:
            raise MegaUsageError(str(exc)) from None
    first = prefixes[0]
    for prefix in prefixes[1:]:
        if dtypes[prefix] != dtypes[first]:
            raise MegaUsageError(
                f"--input {prefix}: token dtype {dtypes[prefix]} differs from {first}'s"
                f" {dtypes[first]}; only datasets of one dtype (one tokenizer) can be merged"
            )
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(prefix) == out for prefix in prefixes):
        raise MegaUsageError(f"--output-prefix {output_prefix}: is also an --input")
    directory = os.path.dirname(output_prefix) or "."
    if not os.path.isdir(directory):
        raise MegaUsageError(
            f"--output-prefix {output_prefix}: directory '{directory}' does not exist"
        )

    try:
        builder = IndexedDatasetBuilder(output_prefix, dtype=dtypes[first])
    except OSError as exc:
        raise MegaUsageError(
            f"--output-prefix {output_prefix}: cannot write: {exc.strerror}"
        ) from None
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize()
    except OSError as exc:
        builder.abort()
        raise MegaUsageError(
            f"--output-prefix {output_prefix}: cannot write: {exc.strerror}"
        ) from None
    except BaseException:
        builder.abort()
        raise
    merged = IndexedDataset(output_prefix)
    return MergeResult(
        prefixes=prefixes,
        output=output_prefix,
        dtype=np.dtype(dtypes[first]).name,
        sequences=len(merged),
        documents=merged.num_documents,
        tokens=merged.num_tokens,
        seconds=time.perf_counter() - start,
    )
