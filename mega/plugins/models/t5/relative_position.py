"""The original T5's relative position bias (``--position-embedding-type relative``).

Each attention head learns one scalar per bucket of key-minus-query distance, added to its
attention scores. Half the buckets hold exact distances, the rest grow logarithmically up to
``max_distance``, beyond which all distances share the last bucket. The encoder's buckets tell
left from right (``bidirectional``); the decoder's only look back. The bucketing is T5's (Raffel
et al. 2020), as Hugging Face's ``T5Attention`` and megatron-core's ``RelativePositionEmbedding``
compute it, so converted weights give the same scores.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(
    relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket ids (int64, in ``[0, num_buckets)``) of ``relative`` = key position - query
    position."""
    buckets = torch.zeros_like(relative)
    if bidirectional:  # the upper half of the buckets holds keys to the right of the query
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:  # keys to the right share bucket 0 with distance 0 (the causal mask hides them)
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    # log-spaced from `exact` to `max_distance`; the clamp keeps log(0) out of the positions
    # that `torch.where` takes from the exact half anyway
    scaled = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, large)


class RelativePositionBias(nn.Module):
    """``forward(query_length, key_length)`` -> the bias ``[1, heads, q, k]``.

    ``relative_attention_bias [buckets, heads]`` is megatron-core's name and layout; tensor
    parallelism splits its columns (heads) with the attention heads."""

    def __init__(
        self, heads: int, num_buckets: int, max_distance: int, bidirectional: bool
    ) -> None:
        super().__init__()
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional

    def forward(self, query_length: int, key_length: int) -> torch.Tensor:
        device = self.relative_attention_bias.weight.device
        query = torch.arange(query_length, device=device)[:, None]
        key = torch.arange(key_length, device=device)[None, :]
        bucket = relative_position_bucket(
            key - query, self.bidirectional, self.num_buckets, self.max_distance
        )  # [q, k]
        return self.relative_attention_bias(bucket).permute(2, 0, 1)[None]  # [1, heads, q, k]
