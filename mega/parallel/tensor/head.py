"""The vocab-parallel output head: local logits ``[b, s, V/tp]`` and the vocab-parallel loss.

It replaces a model's parameter-free output head (``LM_HEAD`` in the plan) and receives the
output weight already vocab-sharded (the vocab-parallel word embeddings when tied, or the
column-parallel ``output_layer``). Its input is the final hidden state: replicated, so it is
copied into the TP region (all-reduce of dX in backward), or under sequence parallelism
``[b, s/tp, h]``, all-gathered over the tokens (reduce-scatter backward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mega.parallel.positions import at_positions
from mega.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from mega.parallel.tensor.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence,
    gather_from_tensor_parallel,
)


class VocabParallelOutputHead(nn.Module):
    """``forward(hidden, weight [V/tp, h], labels=None, bias=None [V/tp], positions=None)``: the
    loss ``[b, s]`` (float32) without ever forming ``[b, s, V]``, or ``[1, n]`` at ``positions``
    (as the single-device ``OutputHead``); with no labels, the gathered logits ``[b, s, V]``
    (inference)."""

    def __init__(self, group: Any, sequence_parallel: bool, vocab_size: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size  # ids from here on are padding: logit -inf, as one device

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence(hidden, self.group)  # [b, s/tp, h] -> [b, s, h]
        else:
            hidden = copy_to_tensor_parallel(hidden, self.group)
        if positions is not None:  # the single-device head's positions: [1, n] from here on
            hidden, labels = at_positions(hidden, labels, positions)
        logits = F.linear(hidden, weight, bias)  # [b, s, V/tp]
        rank = 0 if self.group is None else dist.get_rank(self.group)
        vocab_start = rank * weight.shape[0]
        if self.vocab_size is not None:
            real = min(max(self.vocab_size - vocab_start, 0), weight.shape[0])
            if real < weight.shape[0]:
                logits[..., real:] = float("-inf")  # padding; the global max stays finite
        if labels is None:
            return gather_from_tensor_parallel(logits, self.group, dim=-1)  # [b, s, V]
        return vocab_parallel_cross_entropy(logits, labels, vocab_start, self.group)

    def extra_repr(self) -> str:
        return f"sp={self.sequence_parallel}"
