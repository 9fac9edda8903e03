"""Build the train/valid/test sample sources of ``--data-path`` the way megatron-core's
``BlendedMegatronDatasetBuilder`` builds GPTDatasets and BlendedDatasets.

- One prefix without a weight: each split is a GPTDataset of that prefix's sequences
  ``[round(lo*N), round(hi*N))`` (N = the number of *sequences* in the ``.idx``).
- Weighted prefixes: weights are normalized; dataset d of split i is built for
  ``ceil(ceil(n_i*w_d)*(1+surplus))`` samples and the blend holds ``sum_d ceil(n_i*w_d)``.
- Prefixes without weights: each dataset is built for one epoch and weighted by its length; the
  blend holds ``min(n_i, total)`` samples, or (no sample count) every sample once.

Valid and test are skipped (None) when no samples are asked for, when the split string gives
them no weight, or when a prefix's range for them holds no sequences (megatron-core would never
finish building those).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mega.plugins.datasets.gpt.blending import (
    blending_indices,
    exhaustive_blending_indices,
    normalize,
    parse_blend,
    sizes_per_dataset,
)
from mega.plugins.datasets.gpt.cache import cache_key, cached_arrays, idx_fingerprint
from mega.plugins.datasets.gpt.indices import (
    INDEX_ALGORITHM_VERSION,
    build_gpt_indices,
    plan_epochs,
)
from mega.plugins.datasets.gpt.samples import BlendedSamples, GPTSamples, SampleOptions
from mega.plugins.datasets.indexed import IndexedDataset, IndexedDatasetError
from mega.plugins.datasets.splits import SPLIT_NAMES, parse_split, split_ranges

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
BLEND_NAMES = ("dataset_index", "dataset_sample_index")
CACHE_SUBDIR = os.path.join("cache", "GPTDataset_indices")


@dataclass
class SplitPart:
    """One prefix's share of one split (what ``mega data inspect`` summarizes)."""

    prefix: str
    split: str
    sequences: tuple[int, int]  # [lo, hi) of the prefix's sequences
    tokens: int
    samples: int = 0  # samples built (0 when the split was not built)
    epochs: int = 0
    weight: float | None = None
    cache: str = ""  # built, loaded, uncached, or "" when not built
    key: str = ""  # the cache key of its indices


@dataclass
class GPTBuild:
    """What ``build_gpt_splits`` returns: the sources and how they were made."""

    splits: list[Any]  # GPTSamples, BlendedSamples or None, per split
    parts: list[SplitPart] = field(default_factory=list)
    blend_cache: dict[str, str] = field(default_factory=dict)  # split -> cache status
    cache_dir: str = ""


def open_prefix(prefix: str) -> IndexedDataset:
    """The ``.bin/.idx`` pair of a ``--data-path`` prefix, or a one-line error naming it."""
    for suffix in (".idx", ".bin"):
        path = f"{prefix}{suffix}"
        if not os.path.isfile(path):
            hint = ""
            if prefix.endswith((".bin", ".idx")) and os.path.isfile(f"{prefix[:-4]}.idx"):
                hint = f" (give the prefix without the extension: {prefix[:-4]})"
            raise FileNotFoundError(f"--data-path {prefix}: no such file {path}{hint}")
    try:
        return IndexedDataset(prefix)
    except IndexedDatasetError as exc:
        raise ValueError(f"--data-path {prefix}: {exc}") from None


def default_cache_dir(prefixes: list[str]) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), CACHE_SUBDIR)


def _split_description(
    prefix: str, dataset: IndexedDataset, split: str, index: int, sequences: tuple[int, int],
    num_samples: int | None, seq_length: int, seed: int, add_extra_token: int,
) -> dict[str, Any]:  # fmt: skip
    """Everything the three index arrays depend on (it is hashed into the cache key)."""
    return {
        "class": "GPTDataset",
        "index_algorithm_version": INDEX_ALGORITHM_VERSION,
        "dataset_path": os.path.realpath(prefix),
        "idx_file": idx_fingerprint(f"{prefix}.idx"),
        "num_sequences": len(dataset),
        "split": split,
        "split_matrix": parse_split(split),
        "index_split": SPLIT_NAMES[index],
        "sequences": list(sequences),
        "num_samples": num_samples,
        "random_seed": seed,
        "sequence_length": seq_length,
        "add_extra_token_to_sequence": add_extra_token,
        "drop_last_partial_sequence": True,
    }


def build_split_dataset(
    prefix: str,
    dataset: IndexedDataset,
    split: str,
    index: int,
    sequences: tuple[int, int],
    num_samples: int | None,
    seed: int,
    options: SampleOptions,
    cache_dir: str,
) -> tuple[GPTSamples, SplitPart]:
    """One GPTDataset: indices from the cache or built (and cached), wrapped for reading."""
    lo, hi = sequences
    tokens = int(np.sum(dataset.sequence_lengths[lo:hi], dtype=np.int64))
    name = f"{prefix} {SPLIT_NAMES[index]}"
    if tokens == 0:
        raise ValueError(
            f"--data-path {prefix}: the {SPLIT_NAMES[index]} split (sequences {lo}..{hi}) has no"
            " tokens; change --split"
        )
    plan = plan_epochs(tokens, num_samples, options.seq_length, options.add_extra_token)
    if plan.num_samples < 1:
        raise ValueError(
            f"--data-path {prefix}: the {SPLIT_NAMES[index]} split has {tokens} tokens, too few"
            f" for one sample of --seq-length {options.seq_length}"
            f" (needs {options.seq_length + options.add_extra_token})"
        )
    description = _split_description(
        prefix, dataset, split, index, sequences, num_samples, options.seq_length, seed,
        options.add_extra_token,
    )  # fmt: skip
    key = cache_key(description)

    def build() -> dict[str, np.ndarray]:
        documents = np.arange(lo, hi, dtype=np.int32)
        return build_gpt_indices(
            dataset.sequence_lengths, documents, num_samples, options.seq_length, seed,
            options.add_extra_token,
        )  # fmt: skip

    stem = f"{key}-GPTDataset-{SPLIT_NAMES[index]}"
    arrays = cached_arrays(cache_dir, stem, description, INDEX_NAMES, build)
    samples = GPTSamples(dataset, *(arrays[n] for n in INDEX_NAMES), options=options, name=name)
    part = SplitPart(
        prefix=prefix,
        split=SPLIT_NAMES[index],
        sequences=sequences,
        tokens=tokens,
        samples=len(samples),
        epochs=plan.num_epochs,
        cache=arrays.status,
        key=key,
    )
    return samples, part


def build_blend(
    datasets: list[GPTSamples],
    keys: list[str],
    weights: list[float] | None,
    size: int | None,
    index: int,
    cache_dir: str,
) -> tuple[BlendedSamples, str]:
    """A BlendedDataset over ``datasets``; ``weights`` None means exhaustive (each once)."""
    description = {
        "class": "BlendedDataset",
        "index_algorithm_version": INDEX_ALGORITHM_VERSION,
        "datasets": keys,
        "split": SPLIT_NAMES[index],
        "weights": weights,
        "size": size,
    }

    def build() -> dict[str, np.ndarray]:
        if weights is None:
            dataset_index, sample_index = exhaustive_blending_indices([len(d) for d in datasets])
        else:
            dataset_index, sample_index = blending_indices(weights, int(size or 0))
        counts = np.bincount(dataset_index, minlength=len(datasets))
        for number, (count, dataset) in enumerate(zip(counts, datasets, strict=True)):
            if count > len(dataset):  # Megatron raises IndexError here
                raise ValueError(
                    f"the {SPLIT_NAMES[index]} blend asks {count} samples of {dataset.name}, which"
                    f" has {len(dataset)} (dataset {number}); raise --mid-level-dataset-surplus"
                )
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    stem = f"{cache_key(description)}-BlendedDataset-{SPLIT_NAMES[index]}"
    arrays = cached_arrays(cache_dir, stem, description, BLEND_NAMES, build)
    blended = BlendedSamples(
        datasets, arrays["dataset_index"], arrays["dataset_sample_index"],
        name=f"blend {SPLIT_NAMES[index]}",
    )  # fmt: skip
    return blended, arrays.status


def build_gpt_splits(
    data_path: list[str] | tuple[str, ...],
    split: str,
    num_samples: tuple[int | None, int | None, int | None],
    seed: int,
    options: SampleOptions,
    cache_path: str | None = None,
    surplus: float = 0.005,
    wanted: tuple[bool, bool, bool] = (True, True, True),
) -> GPTBuild:
    """The three splits of ``--data-path`` (None where skipped; see the module doc).

    ``num_samples[i]`` None builds one epoch (Megatron's ``sizes[i] = None``); 0 skips a valid
    or test split. ``wanted[i]`` False skips split i without building anything.
    """
    prefixes, raw_weights = parse_blend(data_path)
    datasets = [open_prefix(prefix) for prefix in prefixes]
    cache_dir = str(cache_path) if cache_path else default_cache_dir(prefixes)
    ranges = [split_ranges(split, len(dataset)) for dataset in datasets]
    weights = normalize(raw_weights) if raw_weights is not None else None
    single = len(prefixes) == 1 and weights is None
    result = GPTBuild(splits=[None, None, None], cache_dir=cache_dir)
    for index, name in enumerate(SPLIT_NAMES):
        requested = num_samples[index]
        if not wanted[index] or (index > 0 and requested == 0):
            continue
        missing = [p for p, r in zip(prefixes, ranges, strict=True) if r[index] is None]
        if missing:
            if index == 0:
                raise ValueError(
                    f"--split {split!r} leaves no sequences for the train split of {missing[0]}"
                )
            continue
        if weights is not None:
            if requested is None:
                raise ValueError(f"a weighted --data-path blend needs a {name} sample count")
            targets = sizes_per_dataset(weights, requested)
            buffers = sizes_per_dataset(weights, requested, surplus)
        else:
            targets = buffers = [requested if single else None] * len(prefixes)
        members, keys = [], []
        for d, prefix in enumerate(prefixes):
            samples, part = build_split_dataset(
                prefix, datasets[d], split, index, ranges[d][index], buffers[d], seed, options,
                cache_dir,
            )  # fmt: skip
            part.weight = None if weights is None else weights[d]
            result.parts.append(part)
            members.append(samples)
            keys.append(part.key)
        if single:
            result.splits[index] = members[0]
            continue
        if weights is not None:
            blend_weights, size = normalize(weights), sum(targets)  # BlendedDataset renormalizes
        else:
            lengths = [len(m) for m in members]
            if requested is None:
                blend_weights, size = None, None
            else:
                blend_weights, size = normalize(lengths), min(requested, sum(lengths))
        blended, status = build_blend(members, keys, blend_weights, size, index, cache_dir)
        result.splits[index] = blended
        result.blend_cache[name] = status
    return result


def prefix_summary(prefix: str, split: str) -> list[SplitPart]:
    """Per split: the sequences, tokens and one-epoch samples, without building any index."""
    dataset = open_prefix(prefix)
    parts = []
    for index, bounds in enumerate(split_ranges(split, len(dataset))):
        lo, hi = bounds if bounds is not None else (0, 0)
        tokens = int(np.sum(dataset.sequence_lengths[lo:hi], dtype=np.int64))
        parts.append(SplitPart(prefix, SPLIT_NAMES[index], (lo, hi), tokens))
    return parts
