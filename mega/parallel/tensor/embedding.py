"""Vocab-parallel embedding (Megatron's ``VocabParallelEmbedding``).

Rank ``r`` holds the contiguous vocabulary rows ``[r V/tp, (r+1) V/tp)``. Ids outside that range
are looked up as row 0 and their vectors zeroed, so after a SUM all-reduce every rank has the
full ``[b, s, h]`` lookup. (Under sequence parallelism the split along the sequence happens later,
after position embeddings are added: see ``SEQUENCE_SCATTER`` in ``apply.py``.) The engine pads
the vocabulary to a multiple of 128 x TP, so the rows split evenly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mega.parallel.shard import ShardSpec
from mega.parallel.tensor.linear import shard_parameter
from mega.parallel.tensor.mappings import reduce_from_tensor_parallel


class VocabParallelEmbedding(nn.Module):
    """``weight [V/tp, h]``; ``forward(ids [b, s]) -> [b, s, h]`` replicated on every TP rank."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group: Any) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.group = group

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: Any, rank: int, size: int
    ) -> VocabParallelEmbedding:
        vocab = embedding.weight.shape[0]
        if vocab % size:
            raise ValueError(
                f"the padded vocabulary ({vocab}) must be divisible by "
                f"--tensor-model-parallel-size ({size})"
            )
        spec = ShardSpec(tuple(embedding.weight.shape), 0, 1, rank, size)
        return cls(shard_parameter(embedding.weight, spec), spec.ranges()[0][0], group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight)  # [b, s, h]
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(partial, self.group)

    def extra_repr(self) -> str:
        return f"vocab [{self.vocab_start}, {self.vocab_end}), h={self.weight.shape[1]}"
