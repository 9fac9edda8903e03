"""``--cp-comm-type p2p``: ring attention. Keys and values pass around the context-parallel ring.

Forward: at step ``i`` rank ``r`` holds the keys and values of rank ``r - i``; it posts their
send to the next rank (and the receive of the following block) before computing, so the transfer
overlaps the attention. With the zigzag layout (:mod:`.layout`: rank ``r`` holds chunks ``r`` and
``2cp-1-r``) every step is one kernel call, as in zigzag ring flash attention:

- its own keys: causal attention of all its queries over all its keys (the concatenated chunks
  keep the causal order: chunk ``r`` sees none of chunk ``2cp-1-r``);
- an earlier rank's (``source < r``): all its queries over the source's first chunk, in full
  (both of its chunks come after it; the source's second chunk comes after both);
- a later rank's: its second chunk's queries over all the source's keys, in full (its first
  chunk comes before both).

The blocks merge by their log-sum-exp. Forward keeps the last block it received (rank
``r + 1``'s), so backward starts on it without a transfer and goes around the ring the other
way: at step ``j`` rank ``r`` computes the block of rank ``r + 1 + j``, its own last. Each remote
block's gradient accumulator travels with it towards its owner; every rank adds its queries'
share and sends it on while the next block computes, and the owner's own block, computed last,
hides the arrival of the accumulator that the others filled. So no transfer waits uncovered, and
at ``cp = 2`` backward sends no keys or values at all (one accumulator each way). Two blocks of
keys and values are held at a time during a step, and one more per layer until its backward.

Precision: the kernels' outputs are in the model's dtype. Forward's merges are float32 beyond
two ranks (with two, each is two terms of that dtype, which one rounding of their float32 sum
gives exactly as an add in that dtype does). Backward's gradient accumulators stay in the
model's dtype at every size, as in Transformer Engine's ring (what Megatron runs): a block's
``cp`` parts cost ``cp - 1`` roundings more than a float32 sum, while float32 accumulators
double their own bytes and what each backward step sends (a 16k CP4 rank on one H200 took 976
ms a step with them, 931 without).

Under torch.compile forward and backward are each one opaque custom op (no graph break: the
layer around the ring compiles whole); elsewhere their Python bodies run as they are. On GPUs
each pass may be replayed as a CUDA graph instead (``MEGA_CP_RING_GRAPHS=1``, :mod:`.graphed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.parallel.context.blocks import (
    CAUSAL,
    FULL,
    block_backward,
    block_forward,
    keys_and_values,
    merge_into,
)
from mega.parallel.context.graphed import graphed_pass
from mega.parallel.context.lanes import lane
from mega.parallel.weight_grad import OpaqueWhenTraced

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


def _wide(cp: int) -> bool:
    """Whether forward's merges are kept in float32: more than two terms (see the docstring)."""
    return cp > 2


def _forward_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_name: str,
    following: int,
    previous: int,
    rank: int,
    cp: int,
    scale: float,
    blocks: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(context ``[b, s_local, h, d]`` in ``q``'s dtype, lse ``[b, h, s_local]`` float32, the
    last block received ``[2, b, g, s_local, d]``)."""
    group = _resolve_process_group(group_name)
    # contiguous [2, b, g, s_local, d]: what travels. Stacked inside the op: where torch.compile
    # traced it the copy was 1% faster at CP2 (16k and 32k, 2 H200) but stayed saved for backward
    # beside the projection output that q and v view, 1.5-3 GB more a GPU
    kv = keys_and_values(k, v)
    ahead = lane(group, following, previous, "forward keys and values", kv)
    out = lse = None
    for step in range(cp):
        posted = ahead.send([kv]) if step < cp - 1 else None
        rows, keys, mode = _step(rank, (rank - step) % cp)
        q_rows, k_cols, v_cols = _part(q, rows), _part(kv[0], keys), _part(kv[1], keys)
        part = block_forward(q_rows, k_cols, v_cols, mode, scale, blocks)
        if out is None:  # step 0: all queries, the accumulators' first values
            out, lse = (part[0].float() if _wide(cp) else part[0]), part[1]
        else:  # merged in place into the rows' accumulators (all, or one half)
            merge_into(_part(out, rows), _part(lse[..., None], rows)[..., 0], part)
        if posted is not None:
            (kv,) = posted.wait()
    kv = ahead.own(kv)  # backward starts on it
    ahead.finish()
    context = out.to(q.dtype).transpose(1, 2).contiguous()  # no copy where the kernel wrote b,s,h,d
    return context, lse.contiguous(), kv  # the strides the fake declares


_forward = OpaqueWhenTraced("mega::ring_attention_forward", graphed_pass(_forward_body))


@_forward.op.register_fake
def _(q, k, v, group_name, following, previous, rank, cp, scale, blocks):  # noqa: ANN001, ANN202
    b, h, s, d = q.shape
    lse = q.new_empty((b, h, s), dtype=torch.float32)
    return q.new_empty((b, s, h, d)), lse, k.new_empty((2, *k.shape))


def _accumulate(
    acc: torch.Tensor | None,
    part: torch.Tensor,
    which: Any,
    zeros: Callable[[torch.dtype], torch.Tensor],
) -> torch.Tensor:
    """``acc`` with ``part`` added to its positions ``which``. A first part of all positions is
    the accumulator itself (no zeros written and added to); else a new one is
    ``zeros(part.dtype)``: every rank's blocks come from the same kernel, so the accumulators
    that travel have one dtype around the ring."""
    if acc is None and which == ALL:
        return part
    if acc is None:
        acc = zeros(part.dtype)
    _part(acc, which).add_(part)
    return acc


def _backward_body(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv: torch.Tensor,
    group_name: str,
    following: int,
    previous: int,
    rank: int,
    cp: int,
    scale: float,
    blocks: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq ``[b, s_local, h, d]``, dk, dv ``[b, g, s_local, d]``), contiguous; ``kv``: the last
    block forward received (rank ``rank + 1``'s)."""
    group = _resolve_process_group(group_name)
    lse = lse[..., None]  # halves of it sliced like the others' positions
    # the halves' contiguous copies of what the kernels read as contiguous, made once; the
    # queries go as they are (strided views: the kernels take any strides)
    halves: dict[Any, tuple] = {}
    dq = None

    def dq_zeros(dtype: torch.dtype) -> torch.Tensor:  # b, s, h, d: as the projections take it
        return q.new_zeros(q.transpose(1, 2).shape, dtype=dtype).transpose(1, 2)

    def kv_zeros(dtype: torch.dtype) -> torch.Tensor:
        return k.new_zeros(k.shape, dtype=dtype)

    behind = lane(group, previous, following, "backward keys and values", kv)
    sums = lane(group, previous, following, "backward key and value gradients", kv)
    arriving = None  # the accumulators of the next block, on their way here
    for step in range(cp):
        source = (rank + 1 + step) % cp
        # the next remote block travels while this one is computed
        posted = behind.send([kv]) if step < cp - 2 else None
        keys, values = (k, v) if source == rank else (kv[0], kv[1])
        rows, cols, mode = _step(rank, source)
        if rows not in halves:
            halves[rows] = tuple(_part(x, rows).contiguous() for x in (dout, out, lse))
        dout_r, out_r, lse_r = halves[rows]
        dq_part, dk, dv = block_backward(
            dout_r, _part(q, rows), _part(keys, cols), _part(values, cols), out_r, lse_r[..., 0],
            mode, scale, blocks,
        )  # fmt: skip
        dq = _accumulate(dq, dq_part, rows, dq_zeros)
        if arriving is None:  # the first block: this rank starts its accumulator (contiguous,
            # as the transfers need)
            acc_k = _accumulate(None, dk, cols, kv_zeros).contiguous()
            acc_v = _accumulate(None, dv, cols, kv_zeros).contiguous()
        else:  # the others' shares of this block, sent during this step's compute
            acc_k, acc_v = arriving.wait()
            _part(acc_k, cols).add_(dk)
            _part(acc_v, cols).add_(dv)
        if source != rank:  # on towards the block's owner
            arriving = sums.send([acc_k, acc_v])
        if posted is not None:
            (kv,) = posted.wait()
    dtype = q.dtype
    dq = dq.transpose(1, 2).contiguous()  # no copy where the kernel wrote the queries' layout
    dk, dv = (sums.own(acc.contiguous().to(dtype)) for acc in (acc_k, acc_v))
    behind.finish()
    sums.finish()
    return dq.to(dtype), dk, dv


_backward = OpaqueWhenTraced("mega::ring_attention_backward", graphed_pass(_backward_body))


@_backward.op.register_fake
def _(dout, q, k, v, out, lse, kv, group_name, following, previous, rank, cp, scale, blocks):  # noqa: ANN001, ANN202
    b, h, s, d = q.shape
    return q.new_empty((b, s, h, d)), k.new_empty(k.shape), v.new_empty(v.shape)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, *args: Any):  # noqa: ANN001
        context, lse, kv = _forward(q, k, v, *args)
        ctx.save_for_backward(q, k, v, context, lse, kv)
        ctx.args = args
        return context

    @staticmethod
    def backward(ctx, dcontext):  # noqa: ANN001
        q, k, v, context, lse, kv = ctx.saved_tensors
        dout, out = (x.transpose(1, 2) for x in (dcontext, context))
        dq, dk, dv = _backward(dout, q, k, v, out, lse, kv, *ctx.args)
        return dq.transpose(1, 2), dk, dv, *[None] * len(ctx.args)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    peers: tuple[int, int],
    rank: int,
    cp: int,
    scale: float,
    blocks: str = "auto",
) -> torch.Tensor:
    """Causal attention of this rank's queries ``q [b, h, s_local, d]`` over the whole sequence,
    keys and values ``[b, g, s_local, d]`` passed around the ring; ``peers``: the global ranks of
    the next and the previous member of ``group``. ``[b, h, s_local, d]`` (a view of a
    ``[b, s_local, h, d]`` tensor). ``blocks``: the attention kernel's block implementation
    (``mega.parallel.attention_kernels``)."""
    following, previous = peers
    args = (group.group_name, following, previous, rank, cp, scale, blocks)
    return _RingAttention.apply(q, k, v, *args).transpose(1, 2)
