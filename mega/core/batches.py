"""Turn a dataset split into micro-batches at an exact data position (consumed samples).

Sample ``consumed + k`` of the split is the k-th sample of the next global batch, so the data
position is a single integer and resuming from a checkpoint continues the same sequence.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def global_batch(
    source: Any, start: int, global_batch_size: int, micro_batch_size: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Samples ``start .. start+global_batch_size`` of ``source`` as micro-batch dicts of tensors
    (every key the samples have: tokens, labels, loss_mask, and e.g. position_ids)."""
    length = len(source)
    microbatches = []
    for first in range(start, start + global_batch_size, micro_batch_size):
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
