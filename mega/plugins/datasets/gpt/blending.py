"""Megatron's blends: ``--data-path`` parsing, per-dataset sizes, and the blending indices.

``blending_indices`` equals ``helpers.cpp:build_blending_indices``: sample i goes to the dataset d
that maximizes ``w[d] * max(i, 1) - count[d]`` (float64, ties to the lowest d). That greedy is a
sequential recurrence, so it is run for many chunks of the sample range at once (one numpy step
advances every chunk): chunk 0 starts from zero counts, every other chunk from a guess. The
greedy corrects a wrong start within a few steps (its trajectories merge), so each chunk is then
re-run from its predecessor's end state until the chunk's trajectory joins the one it had; a
chain of chunks whose starts equal their predecessors' ends is exact. Each pass makes at least
one more chunk exact, so the result is always the sequential one; in practice two passes do.
"""

from __future__ import annotations

import math

import numpy as np

# Steps per chunk: long enough for a wrong start to be corrected inside the chunk (tens to a few
# thousand steps), short enough that small blends need few numpy steps: about 2*sqrt(size).
MIN_CHUNK_STEPS, MAX_CHUNK_STEPS = 512, 8192


def parse_blend(data_path: list[str] | tuple[str, ...]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as (prefixes, weights or None), Megatron's ``get_blend_from_list`` rules.

    An odd count is a list of prefixes. An even count is weight/prefix pairs when every second
    item (from the first) is a number, and a list of prefixes when none is.
    """
    items = [str(item) for item in data_path]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) % 2 == 1:
        numbers = [item for item in items if _is_number(item) and not _is_prefix(item)]
        if numbers and len(items) > 1:  # "0.7 a b": a blend missing a weight or a prefix
            raise ValueError(
                f"--data-path {' '.join(items)}: {numbers[0]!r} looks like a blend weight, but a"
                f" blend is weight/prefix pairs (w1 p1 w2 p2 ...) and these {len(items)} items"
                " do not pair up; give every prefix its weight, or no weights at all"
            )
        return [item.strip() for item in items], None
    weights: list[float | None] = []
    for raw in items[0::2]:
        try:
            weights.append(float(raw))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return [item.strip() for item in items], None
    if any(w is None for w in weights):
        bad = next(raw for raw, w in zip(items[0::2], weights, strict=True) if w is None)
        raise ValueError(
            f"--data-path {' '.join(items)}: expected weight/prefix pairs, but {bad!r} is not a number"
        )
    floats = [float(w) for w in weights if w is not None]
    if any(not math.isfinite(w) or w <= 0 for w in floats):
        raise ValueError(f"--data-path weights must be positive numbers, got {floats}")
    return [item.strip() for item in items[1::2]], floats


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_prefix(text: str) -> bool:
    """A dataset whose prefix happens to be a number (``0.7.bin``/``0.7.idx``) is still one."""
    import os

    return os.path.isfile(f"{text.strip()}.idx")


def normalize(weights: list[float]) -> list[float]:
    """Megatron's ``utils.normalize``: float64 numpy division by the numpy sum."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def sizes_per_dataset(
    normalized_weights: list[float], target: int | None, surplus: float = 0.0
) -> list[int | None]:
    """``ceil(ceil(target * w) * (1 + surplus))`` per dataset (``_get_size_per_split_per_dataset``)."""
    if target is None:
        return [None] * len(normalized_weights)
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in normalized_weights]


def _guess_counts(weights: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Integer counts summing to each start, close to ``w * start`` (largest remainders)."""
    ideal = weights[None, :] * starts[:, None].astype(np.float64)
    counts = np.floor(ideal)
    missing = starts - counts.sum(axis=1)
    order = np.argsort(counts - ideal, axis=1, kind="stable")  # largest remainder first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(len(weights))[None, :].repeat(len(starts), 0), 1)
    counts += rank < missing[:, None]
    return counts


def _run_chunks(
    weights: np.ndarray,
    quotas: np.ndarray | None,
    starts: np.ndarray,
    counts: np.ndarray,
    steps: int,
    picks: np.ndarray,
    previous: np.ndarray | None = None,
) -> np.ndarray:
    """Advance every chunk ``steps`` greedy steps from ``counts`` (float64, updated in place).

    Writes the picks into ``picks`` [chunks, steps]. With ``previous`` (each chunk's old start
    counts), a chunk stops once its counts equal its old trajectory's at the same step: from
    there on its old picks stand. Returns the chunks that never joined (their end changed).
    """
    active = np.arange(len(starts))
    row_weights = weights[None, :]
    for t in range(steps):
        if previous is not None:
            joined = (counts[active] == previous[active]).all(axis=1)
            if joined.any():
                active = active[~joined]
                if len(active) == 0:
                    break
        c = counts[active]
        x = np.maximum(starts[active] + t, 1).astype(np.float64)
        error = row_weights * x[:, None] - c  # the same float64 expression as helpers.cpp
        if quotas is not None:  # exhaustive: a dataset whose quota is spent is never chosen
            error[c >= quotas[None, :]] = -np.inf
        chosen = error.argmax(axis=1)  # first maximum: ties go to the lowest dataset
        if previous is not None:
            previous[active, picks[active, t]] += 1.0
        picks[active, t] = chosen
        counts[active, chosen] += 1.0
    return active


def _greedy(weights: np.ndarray, size: int, quotas: np.ndarray | None) -> np.ndarray:
    """The greedy assignment of ``size`` samples as int16 dataset ids (see the module doc)."""
    num = len(weights)
    if size <= 0:
        return np.zeros(0, dtype=np.int16)
    if num == 1:
        return np.zeros(size, dtype=np.int16)
    steps = min(size, max(MIN_CHUNK_STEPS, min(MAX_CHUNK_STEPS, int(2 * math.sqrt(size)))))
    chunks = -(-size // steps)
    starts = np.arange(chunks, dtype=np.int64) * steps
    start_counts = _guess_counts(weights, starts)
    start_counts[0] = 0.0
    picks = np.empty((chunks, steps), dtype=np.int16)
    ends = start_counts.copy()
    _run_chunks(weights, quotas, starts, ends, steps, picks)
    while True:
        linked = np.ones(chunks, dtype=bool)
        linked[1:] = (ends[:-1] == start_counts[1:]).all(axis=1)
        exact = np.logical_and.accumulate(linked)
        if exact.all():
            break
        redo = np.flatnonzero(~exact)
        old_starts = start_counts[redo].copy()
        start_counts[redo] = ends[redo - 1]
        counts = start_counts[redo].copy()
        redo_picks = picks[redo]
        unjoined = _run_chunks(weights, quotas, starts[redo], counts, steps, redo_picks, old_starts)
        picks[redo] = redo_picks
        ends[redo[unjoined]] = counts[unjoined]
    return picks.reshape(-1)[:size]


def dataset_sample_index(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each blended sample, how many earlier samples came from the same dataset (int64)."""
    order = np.argsort(dataset_index, kind="stable")
    counts = np.bincount(dataset_index, minlength=num_datasets).astype(np.int64)
    group_starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    out = np.empty(len(dataset_index), dtype=np.int64)
    out[order] = np.arange(len(dataset_index), dtype=np.int64) - np.repeat(group_starts, counts)
    return out


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``helpers.build_blending_indices``: (dataset_index int16, dataset_sample_index int64)."""
    w = np.asarray(weights, dtype=np.float64)
    index = _greedy(w, int(size), None)
    return index, dataset_sample_index(index, len(w))


def exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``helpers.build_exhaustive_blending_indices``: exactly ``sizes[d]`` samples of dataset d."""
    quotas = np.asarray(sizes, dtype=np.int64)
    total = int(quotas.sum())
    w = quotas / np.float64(total)  # sizes[d] / double(total), as helpers.cpp
    index = _greedy(w, total, quotas.astype(np.float64))
    return index, dataset_sample_index(index, len(w))
