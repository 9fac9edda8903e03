"""``--cp-comm-type a2a``: Ulysses. An all-to-all trades the sequence split for a head split.

Before attention each rank holds all heads of its positions; one all-to-all gives it all
positions of ``heads/cp`` heads (key and value groups likewise, so GQA needs groups divisible by
``cp``), the positions are put in sequence order, and the model's own attention kernel runs on
the whole sequence. A second all-to-all brings each rank its positions of every head back. Two
collectives of activations per layer, independent of the sequence length's square.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.context.layout import chunk_layout, global_order
from mega.parallel.expert.collectives import exchange_rows


def _to_heads(x: torch.Tensor, group: Any, cp: int, order: list[int]) -> torch.Tensor:
    """``[b, s_local, n, d]`` (all heads, this rank's positions) -> ``[b, s, n/cp, d]`` (this
    rank's heads, every position in sequence order)."""
    b, s_local, n, d = x.shape
    parts = x.view(b, s_local, cp, n // cp, d).permute(2, 0, 1, 3, 4).reshape(cp * b, -1)
    parts = exchange_rows(parts, [b] * cp, [b] * cp, group)  # part j: rank j's positions
    chunks = parts.view(cp, b, 2, s_local // 2, n // cp, d).transpose(0, 1)
    # [b, rank, its two chunks, ...]: global chunk c is chunks[:, o // 2, o % 2], o = order[c]
    ordered = torch.stack([chunks[:, o // 2, o % 2] for o in order], dim=1)
    return ordered.reshape(b, cp * s_local, n // cp, d)


def _to_positions(x: torch.Tensor, group: Any, cp: int, layout: list[int]) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: ``[b, s, n/cp, d]`` -> ``[b, s_local, n, d]``."""
    b, s, n_local, d = x.shape
    s_local = s // cp
    chunks = x.view(b, 2 * cp, s_local // 2, n_local, d)
    chunks = torch.stack([chunks[:, c] for c in layout], dim=1)  # rank after rank
    parts = chunks.view(b, cp, s_local, n_local, d).transpose(0, 1).reshape(cp * b, -1)
    parts = exchange_rows(parts, [b] * cp, [b] * cp, group)  # part j: rank j's heads
    parts = parts.view(cp, b, s_local, n_local, d).permute(1, 2, 0, 3, 4)
    return parts.reshape(b, s_local, cp * n_local, d)


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
    # host lists, the chunks moved by one stack of slices: an index tensor cached per device
    # failed inside the planner's trace on the meta device, which then counted the layer eager
    order, layout = global_order(cp), chunk_layout(cp)
    heads = [_to_heads(x, group, cp, order) for x in (q, k, v)]
    context = attend(*heads)  # [b, s, h/cp * d]
    b, s, _ = context.shape
    context = context.view(b, s, q.shape[2] // cp, q.shape[3])
    return _to_positions(context, group, cp, layout).reshape(b, s // cp, -1)
