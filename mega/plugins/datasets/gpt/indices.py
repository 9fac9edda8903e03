"""The three index arrays of Megatron's GPTDataset, built with numpy alone (no C++ helper).

Given the split's sequence ids ``documents`` (Megatron calls them documents; for GPT they are the
``.idx`` *sequences*), the sequence length S, X = ``add_extra_token_to_sequence`` (1) and T = the
tokens in ``documents``, ``build_gpt_indices`` returns what megatron-core 0.16.1's
``GPTDataset._build_document_sample_shuffle_indices`` builds, bit for bit:

- ``document_index`` int32: ``documents`` tiled once per epoch and shuffled with one
  ``numpy.random.RandomState(seed)`` (the last epoch shuffled on its own when it is "separate").
- ``sample_index`` [N+1, 2]: sample k covers the flattened token stream (documents in
  ``document_index`` order) from position k*S to k*S+S+X; row k is (position in
  ``document_index``, token offset) of the document holding token k*S, taken as the first
  document whose end reaches k*S+X (Megatron's walk stops there). Megatron walks the documents
  in C++ (``helpers.cpp:build_sample_idx``); here it is one ``cumsum`` of the lengths in
  ``document_index`` order and one ``searchsorted`` for all N targets.
- ``shuffle_index``: a permutation of [0, N) from the same RandomState (two when separate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT32_MAX = np.iinfo(np.int32).max
# The cache key records this; change it whenever the arrays built here could change.
INDEX_ALGORITHM_VERSION = 1
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass(frozen=True)
class EpochPlan:
    """How many epochs a split needs, and whether the last one is shuffled on its own."""

    tokens_per_epoch: int
    num_epochs: int
    separate_final_epoch: bool
    num_samples: int  # N, the samples the sample index holds
    samples_sans_final_epoch: int  # the first shuffle range when the final epoch is separate


def num_epochs_needed(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: int = 1
) -> int:
    """The smallest E >= 1 with E*T >= num_samples*S + X (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("cannot draw samples from a split with no tokens")
    requested = int(num_samples) * int(seq_length) + int(add_extra_token)
    return max(1, -(-requested // int(tokens_per_epoch)))


def plan_epochs(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: int = 1
) -> EpochPlan:
    """Megatron's epoch count and its separate-final-epoch rule (threshold 80%)."""
    T, S, X = int(tokens_per_epoch), int(seq_length), int(add_extra_token)
    epochs = num_epochs_needed(T, num_samples, S, X)
    separate = False
    sans = 0
    if epochs > 1:
        sans = ((epochs - 1) * T - X) // S
        from_final = int(num_samples) - sans
        per_epoch = (T - X) // S
        if not 0 <= from_final <= per_epoch + 1:  # Megatron asserts both
            raise AssertionError(f"final epoch would hold {from_final} of {per_epoch} samples")
        separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    total = max(0, (epochs * T - X) // S)
    return EpochPlan(T, epochs, separate, total, sans if separate else total)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times (int32), shuffled as Megatron shuffles it."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)  # the draws depend only on the length: same permutation as Megatron
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    add_extra_token: int = 1,
) -> np.ndarray:
    """Equal to ``helpers.build_sample_idx`` (drop_last_partial_sequence=True), vectorised.

    ``sizes`` are the lengths of *all* sequences of the ``.idx`` (they also decide the dtype:
    int32 unless ``max(len(document_index), max(sizes))`` exceeds it, as Megatron does).
    """
    S, X = int(seq_length), int(add_extra_token)
    count = (int(num_epochs) * int(tokens_per_epoch) - X) // S
    biggest = max(len(document_index), int(sizes.max()) if len(sizes) else 0)
    dtype = np.int32 if biggest <= INT32_MAX else np.int64
    out = np.zeros((max(count, 0) + 1, 2), dtype=dtype)
    if count <= 0:
        return out
    # End (exclusive) of each document of the flattened stream, in document_index order.
    ends = np.cumsum(sizes[document_index], dtype=np.int64)
    starts_of_samples = np.arange(1, count + 1, dtype=np.int64) * S
    # Megatron's walk stops in the first document whose end reaches the sample end minus nothing
    # else: sample k-1 ends at k*S + X, so row k is the first document with end >= k*S + X.
    position = np.searchsorted(ends, starts_of_samples + X, side="left")
    offset = starts_of_samples - (ends[position] - sizes[document_index[position]])
    out[1:, 0] = position
    out[1:, 1] = offset
    return out


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of [0, num_samples), then of [num_samples, total_size) (uint32 or int64)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
    add_extra_token: int = 1,
) -> dict[str, np.ndarray]:
    """document_index, sample_index and shuffle_index for one split, as megatron-core builds them."""
    tokens = int(np.sum(sizes[documents], dtype=np.int64))
    plan = plan_epochs(tokens, num_samples, seq_length, add_extra_token)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(
        documents, plan.num_epochs, rng, plan.separate_final_epoch
    )
    sample_index = build_sample_index(
        sizes, document_index, seq_length, plan.num_epochs, tokens, add_extra_token
    )
    total = len(sample_index) - 1
    first = plan.samples_sans_final_epoch if plan.separate_final_epoch else total
    shuffle_index = build_shuffle_index(first, total, rng)
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }
