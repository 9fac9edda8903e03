"""``--cp-comm-type p2p``: ring attention. Keys and values pass around the context-parallel ring.

At step ``i`` rank ``r`` holds the keys and values of rank ``r - i``; it posts their send to the
next rank (and the receive of the following block) before computing, so the transfer overlaps
the attention. With the zigzag layout (:mod:`.layout`: rank ``r`` holds chunks ``r`` and
``2cp-1-r``) every step is one kernel call, as in zigzag ring flash attention:

- its own keys: causal attention of all its queries over all its keys (the concatenated chunks
  keep the causal order: chunk ``r`` sees none of chunk ``2cp-1-r``);
- an earlier rank's (``source < r``): all its queries over the source's first chunk, in full
  (both of its chunks come after it; the source's second chunk comes after both);
- a later rank's: its second chunk's queries over all the source's keys, in full (its first
  chunk comes before both).

The blocks merge into float32 accumulators by their log-sum-exp. Backward goes around the ring
again: each block of keys and values travels with its gradient accumulator (float32, so the sum
over the ring is not rounded at every step), which every rank adds its queries' share to and
which arrives back at its owner after ``cp`` steps. An accumulator is sent on as soon as this
rank's share is in it and received while the next block is computed, so neither transfer waits
for the other's compute. Two blocks of keys and values are held at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel import comm
from mega.parallel.context.blocks import CAUSAL, FULL, block_backward, block_forward, merge

ALL, FIRST, SECOND = "all", 0, 1


def _step(rank: int, source: int) -> tuple[Any, Any, str]:
    """(which queries, which keys, mode) rank ``rank`` computes with the keys of ``source``:
    ``ALL`` or one half (``FIRST``/``SECOND``) of the local positions."""
    if source == rank:
        return ALL, ALL, CAUSAL
    return (ALL, FIRST, FULL) if source < rank else (SECOND, ALL, FULL)


def _part(x: torch.Tensor, which: Any) -> torch.Tensor:
    """``x`` (positions on dim -2), or one of its halves."""
    if which == ALL:
        return x
    half = x.shape[-2] // 2
    return x[..., which * half : (which + 1) * half, :]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Any, peers: tuple[int, int], rank: int, cp: int, scale: float):  # noqa: ANN001
        following, previous = peers
        kv = torch.stack((k, v)).contiguous()  # [2, b, g, s_local, d]
        out = lse = None  # float32 accumulators of every local query
        for step in range(cp):
            posted, incoming = None, None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                posted = comm.exchange([(kv, following)], [(incoming, previous)], group, wait=False)
            rows, keys, mode = _step(rank, (rank - step) % cp)
            part = block_forward(
                _part(q, rows), _part(kv[0], keys), _part(kv[1], keys), mode, scale
            )
            if out is None:  # step 0: all queries, the accumulators' first values
                out, lse = part[0].float(), part[1]
            elif rows == ALL:
                out, lse = merge((out, lse), part)
            else:  # one half of the queries: merged into its half of the accumulators
                merged = merge((_part(out, rows), _part(lse[..., None], rows)[..., 0]), part)
                _part(out, rows).copy_(merged[0])
                _part(lse[..., None], rows)[..., 0].copy_(merged[1])
            if posted is not None:
                posted.wait()
                kv = incoming
        out = out.to(q.dtype)  # kept in the model's dtype
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.peers, ctx.rank, ctx.cp, ctx.scale = group, peers, rank, cp, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        following, previous = ctx.peers
        rank, cp, scale = ctx.rank, ctx.cp, ctx.scale
        kv = torch.stack((k, v)).contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dout = dout.contiguous()
        lse = lse[..., None]  # halves of it sliced like the others' positions
        halves: dict[Any, tuple] = {}  # the second half's contiguous copies, made once
        dkv = moving = None  # the accumulator of the block in hand; the one posted
        for step in range(cp):
            posted, incoming = None, None
            if step < cp - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                posted = comm.exchange([(kv, following)], [(incoming, previous)], ctx.group, False)
            rows, keys, mode = _step(rank, (rank - step) % cp)
            if rows not in halves:
                halves[rows] = tuple(_part(x, rows).contiguous() for x in (dout, q, out, lse))
            dout_r, q_r, out_r, lse_r = halves[rows]
            dq_part, dk, dv = block_backward(
                dout_r, q_r, _part(kv[0], keys), _part(kv[1], keys), out_r, lse_r[..., 0],
                mode, scale,
            )  # fmt: skip
            _part(dq, rows).add_(dq_part)
            if moving is None:  # step 0: this rank's own block starts its accumulator
                dkv = torch.zeros_like(kv, dtype=torch.float32)
            else:  # the block's accumulator from the previous rank, sent during this compute
                moving[0].wait()
                dkv = moving[1]
            _part(dkv[0], keys).add_(dk)
            _part(dkv[1], keys).add_(dv)
            arriving = torch.empty_like(dkv)
            moving = (
                comm.exchange([(dkv, following)], [(arriving, previous)], ctx.group, False),
                arriving,
            )
            if posted is not None:
                posted.wait()
                kv = incoming
        moving[0].wait()  # after the last step: this rank's own block, summed over the ring
        dkv = moving[1]
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
