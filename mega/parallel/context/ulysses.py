"""``--cp-comm-type a2a``: Ulysses. An all-to-all trades the sequence split for a head split.

Before attention each rank holds all heads of its positions; one all-to-all gives it all
positions of ``heads/cp`` heads (key and value groups likewise, so GQA needs groups divisible by
``cp``), the positions are put in sequence order, and the model's own attention kernel runs on
the whole sequence. A second all-to-all brings each rank its positions of every head back. Two
collectives of activations per layer, independent of the sequence length's square.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mega.parallel.context.layout import global_order
from mega.parallel.expert.collectives import exchange_rows


def _to_heads(x: torch.Tensor, group: Any, cp: int, order: torch.Tensor) -> torch.Tensor:
    """``[b, s_local, n, d]`` (all heads, this rank's positions) -> ``[b, s, n/cp, d]`` (this
    rank's heads, every position in sequence order)."""
    b, s_local, n, d = x.shape
    parts = x.view(b, s_local, cp, n // cp, d).permute(2, 0, 1, 3, 4).reshape(cp * b, -1)
    parts = exchange_rows(parts, [b] * cp, [b] * cp, group)  # part j: rank j's positions
    chunks = parts.view(cp, b, 2, s_local // 2, n // cp, d).transpose(0, 1)
    chunks = chunks.reshape(b, 2 * cp, s_local // 2, n // cp, d).index_select(1, order)
    return chunks.reshape(b, cp * s_local, n // cp, d)


def _to_positions(x: torch.Tensor, group: Any, cp: int, layout: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: ``[b, s, n/cp, d]`` -> ``[b, s_local, n, d]``."""
    b, s, n_local, d = x.shape
    s_local = s // cp
    chunks = x.view(b, 2 * cp, s_local // 2, n_local, d).index_select(1, layout)
    parts = chunks.view(b, cp, s_local, n_local, d).transpose(0, 1).reshape(cp * b, -1)
    parts = exchange_rows(parts, [b] * cp, [b] * cp, group)  # part j: rank j's heads
    parts = parts.view(cp, b, s_local, n_local, d).permute(1, 2, 0, 3, 4)
    return parts.reshape(b, s_local, cp * n_local, d)


@functools.cache
def _orders(cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(global order, its inverse) of the chunks as index tensors on ``device``, made once rather
    than copied to the device at every layer."""
    order = torch.tensor(global_order(cp), device=device)
    return order, torch.argsort(order)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attend: Any,
    group: Any,
    cp: int,
) -> torch.Tensor:
    """``q [b, s_local, h, d]``, ``k``/``v [b, s_local, g, d]`` (this rank's positions) ->
    ``attend``'s context ``[b, s_local, h*d]``. ``attend(q, k, v)`` is causal attention over
    a whole sequence in the same layout (the model's core attention)."""
    order, layout = _orders(cp, q.device)
    heads = [_to_heads(x, group, cp, order) for x in (q, k, v)]
    context = attend(*heads)  # [b, s, h/cp * d]
    b, s, _ = context.shape
    context = context.view(b, s, q.shape[2] // cp, q.shape[3])
    return _to_positions(context, group, cp, layout).reshape(b, s // cp, -1)
