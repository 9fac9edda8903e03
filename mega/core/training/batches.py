"""Turn a dataset split into micro-batches at an exact data position (consumed samples).

Sample ``consumed + k`` of the split is the k-th sample of the next global batch, so the data
position is a single integer and resuming from a checkpoint continues the same sequence.
"""

from __future__ import annotations

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
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of samples ``start .. start+global_batch_size``, as
    dicts of tensors (every key the samples have: tokens, labels, loss_mask, e.g. position_ids).

    As in Megatron's sampler, micro-batch ``j`` of the global batch holds samples
    ``start + j*mbs ..`` and goes to rank ``j % dp_size``: every layout groups the same samples
    into the same micro-batches, so the batch mean is layout-invariant.
    """
    length = len(source)
    microbatches = []
    stride = micro_batch_size * dp_size
    for first in range(start + dp_rank * micro_batch_size, start + global_batch_size, stride):
        samples = [source[i % length] for i in range(first, first + micro_batch_size)]
        microbatches.append(
            {
                key: torch.from_numpy(np.stack([s[key] for s in samples])).to(
                    device, non_blocking=True
                )
                for key in samples[0]
            }
        )
    return microbatches


def requested_samples(
    train_iters: int, eval_interval: int, eval_iters: int, gbs: int
) -> tuple[int, int, int]:
    """Megatron's get_train_valid_test_num_samples: how many samples each split must hold."""
    evals = train_iters // eval_interval + 1
    return train_iters * gbs, evals * eval_iters * gbs, eval_iters * gbs
