"""Turn a dataset split into micro-batches at an exact data position (consumed samples).

Sample ``consumed + k`` of the split is the k-th sample of the next global batch, so the data
position is a single integer and resuming from a checkpoint continues the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def global_batch(
    source: Any,
    start: int,
    global_batch_size: int,
    micro_batch_size: int,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
    prepare: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of samples ``start .. start+global_batch_size``, as
    dicts of tensors (every key the samples have: tokens, labels, loss_mask, e.g. position_ids).
    ``prepare`` (the model's ``prepare_microbatch``) sees each micro-batch's stacked arrays on
    the host before they are copied to ``device``.

    As in Megatron's sampler, micro-batch ``j`` of the global batch holds samples
    ``start + j*mbs ..`` and goes to rank ``j % dp_size``: every layout groups the same samples
    into the same micro-batches, so the batch mean is layout-invariant.
    """
    length = len(source)
    microbatches = []
    stride = micro_batch_size * dp_size
    for first in range(start + dp_rank * micro_batch_size, start + global_batch_size, stride):
        samples = [source[i % length] for i in range(first, first + micro_batch_size)]
        arrays = {key: np.stack([s[key] for s in samples]) for key in samples[0]}
        if prepare is not None:
            arrays = prepare(arrays)
        microbatches.append(
            {
                key: torch.from_numpy(values).to(device, non_blocking=True)
                for key, values in arrays.items()
            }
        )
    return microbatches


def requested_samples(
    train_iters: int,
    eval_interval: int,
    eval_iters: int,
    gbs: int,
    train_samples: int | None = None,
) -> tuple[int, int, int]:
    """Megatron's get_train_valid_test_num_samples: how many samples each split must hold
    (``--train-samples`` itself when given, else iterations x global batch)."""
    evals = train_iters // eval_interval + 1
    train = train_samples if train_samples is not None else train_iters * gbs
    return train, evals * eval_iters * gbs, eval_iters * gbs


class BatchPrefetcher:
    """``--num-workers N``: while a step runs, N threads build the next step's micro-batches (one
    micro-batch per task), so reading samples overlaps with compute. 0 builds every batch in the
    loop, when it is needed. The batches are the same either way: only when they are built moves.

    ``build(source, first_sample, batch_size)`` is the engine's ``_microbatches``; a batch of
    ``batch_size`` samples is cut into tasks of ``unit`` samples (micro-batch x data-parallel
    size), each giving this rank's one micro-batch of that stretch."""

    def __init__(self, workers: int, unit: int):
        self.unit = unit
        self._pool = None
        if workers > 0:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mega-batches")
        self._pending: tuple[int, int, int, list] | None = None  # source id, start, size, futures

    def ahead(self, build: Any, source: Any, start: int, size: int) -> None:
        """Start building the batch of ``size`` samples at ``start`` (no-op without workers)."""
        if self._pool is None:
            return
        futures = [
            self._pool.submit(build, source, first, self.unit)
            for first in range(start, start + size, self.unit)
        ]
        self._pending = (id(source), start, size, futures)

    def take(self, build: Any, source: Any, start: int, size: int) -> list:
        """The batch at ``start``: the prefetched one if it is that batch, else built now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[:3] == (id(source), start, size):
            return [mb for future in pending[3] for mb in future.result()]
        return build(source, start, size)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
