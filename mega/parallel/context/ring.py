"""``--cp-comm-type p2p``: ring attention. Keys and values pass around the context-parallel ring.

At step ``i`` rank ``r`` holds the keys and values of rank ``r - i``; it posts their send to the
next rank (and the receive of the following block) before computing their blocks, so the
transfer overlaps the attention. The blocks' results merge by their log-sum-exp. Backward goes
around the ring again: each block of keys and values travels with its gradient accumulator,
which every rank adds its queries' share to, and which arrives back at its owner after ``cp``
steps. Only two blocks of keys and values are held at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel import comm
from mega.parallel.context.blocks import block_backward, block_forward, block_mode, merge
from mega.parallel.context.layout import rank_chunks


def _pairs(rank: int, source: int, cp: int):  # noqa: ANN202
    """(local query half, local key half, mode) of every block rank ``rank`` computes with the
    keys and values of rank ``source``."""
    for qi, q_chunk in enumerate(rank_chunks(rank, cp)):
        for ki, k_chunk in enumerate(rank_chunks(source, cp)):
            mode = block_mode(q_chunk, k_chunk)
            if mode is not None:
                yield qi, ki, mode


def _half(x: torch.Tensor, index: int) -> torch.Tensor:
    half = x.shape[-2] // 2
    return x[..., index * half : (index + 1) * half, :]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Any, peers: tuple[int, int], rank: int, cp: int, scale: float):  # noqa: ANN001
        following, previous = peers
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, s_local, d]
        acc: list[Any] = [None, None]  # (out, lse) of each local query half
        for step in range(cp):
            posted, incoming = None, None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                posted = comm.exchange([(kv, following)], [(incoming, previous)], group, wait=False)
            source = (rank - step) % cp
            for qi, ki, mode in _pairs(rank, source, cp):
                part = block_forward(_half(q, qi), _half(kv[0], ki), _half(kv[1], ki), mode, scale)
                acc[qi] = merge(acc[qi], part)
            if posted is not None:
                posted.wait()
                kv = incoming
        out = torch.cat([a[0] for a in acc], dim=-2).to(q.dtype)  # kept in the model's dtype
        lse = torch.cat([a[1] for a in acc], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.peers, ctx.rank, ctx.cp, ctx.scale = group, peers, rank, cp, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        following, previous = ctx.peers
        rank, cp, scale = ctx.rank, ctx.cp, ctx.scale
        kv = torch.stack((k, v)).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # the gradient of the block in hand
        dq = torch.zeros_like(q, dtype=torch.float32)
        for step in range(cp):
            posted, incoming = None, None
            if step < cp - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                posted = comm.exchange([(kv, following)], [(incoming, previous)], ctx.group, False)
            source = (rank - step) % cp
            for qi, ki, mode in _pairs(rank, source, cp):
                saved = (_half(out, qi), _half(lse[..., None], qi)[..., 0])
                dq_part, dk, dv = block_backward(
                    _half(dout, qi), _half(q, qi), _half(kv[0], ki), _half(kv[1], ki),
                    *saved, mode, scale,
                )  # fmt: skip
                _half(dq, qi).add_(dq_part)
                _half(dkv, ki).add_(torch.stack((dk, dv)))
            # the accumulator moves on with its block (float32, so that the sum over the ring
            # is not rounded at every step); after the last step it reaches its owner
            arriving = torch.empty_like(dkv)
            comm.exchange([(dkv, following)], [(arriving, previous)], ctx.group)
            dkv = arriving
            if posted is not None:
                posted.wait()
                kv = incoming
        dtype = q.dtype
        return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), *[None] * 5


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    peers: tuple[int, int],
    rank: int,
    cp: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this rank's queries ``q [b, h, s_local, d]`` over the whole sequence,
    keys and values ``[b, g, s_local, d]`` passed around the ring; ``peers``: the global ranks of
    the next and the previous member of ``group``. ``[b, h, s_local, d]``."""
    return _RingAttention.apply(q, k, v, group, peers, rank, cp, scale)
