"""``--cp-comm-type all_gather``: gather every rank's keys and values, attend the local queries.

Forward all-gathers the keys and values (one collective), then computes each local query
chunk's attention as two blocks, the earlier chunks in full and its own chunk causally, merged by
their log-sum-exp. Backward gathers them again, computes the gradient of every gathered key and
value and reduce-scatters them to their owners. Simple, and the keys and values of the whole
sequence are held at once while a layer runs: at long sequences, the ring (``p2p``) holds two
blocks. Both passes compute the own chunks' causal blocks from the local keys and values while
the gather is in flight (they need nothing from the other ranks), and the rest after it: the
same kernels on the same values in the same order of sums as gathering first. Under
torch.compile forward and backward are each one opaque custom op (no graph break; their
in-place collectives are not traced).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.parallel import comm
from mega.parallel.context.blocks import (
    CAUSAL,
    FULL,
    block_backward,
    block_forward,
    keys_and_values,
    merge,
)
from mega.parallel.context.layout import rank_chunks
from mega.parallel.weight_grad import OpaqueWhenTraced


def _chunk(kv: torch.Tensor, chunk: int, cp: int) -> torch.Tensor:
    """Global chunk ``chunk`` of gathered ``kv [cp, 2, b, g, s_local, d]``: ``[2, b, g, c, d]``."""
    for rank in range(cp):
        local = rank_chunks(rank, cp)
        if chunk in local:
            half = kv.shape[-2] // 2
            start = local.index(chunk) * half
            return kv[rank, :, :, :, start : start + half]
    raise IndexError(chunk)


def _start_gather(kv: torch.Tensor, group: Any, cp: int) -> tuple[torch.Tensor, Any]:
    """Every rank's ``kv [2, b, g, s_local, d]`` into ``[cp, 2, b, g, s_local, d]``, and the
    handle to wait on before reading it (on CUDA the stream waits, not the host)."""
    gathered = kv.new_empty((cp, *kv.shape))
    work = comm.all_gather_into(gathered.view(cp * 2, *kv.shape[1:]), kv, group, async_op=True)
    return gathered, work


def _wait(work: Any) -> None:
    if work is not None:
        work.wait()


def _own(kv: torch.Tensor, index: int) -> torch.Tensor:
    """This rank's local chunk ``index`` (0 or 1) of ``kv [2, b, g, s_local, d]``: what the
    gathered copy holds for it, read before the gather ends."""
    half = kv.shape[-2] // 2
    return kv[..., index * half : (index + 1) * half, :]


def _forward_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_name: str,
    rank: int,
    cp: int,
    scale: float,
    blocks: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out ``[b, h, s_local, d]`` in ``q``'s dtype, lse, the local ``kv [2, b, g, s_local, d]``)."""
    kv = keys_and_values(k, v)  # [2, b, g, s_local, d]
    gathered, work = _start_gather(kv, _resolve_process_group(group_name), cp)
    half = q.shape[2] // 2
    parts = [q[:, :, index * half : (index + 1) * half] for index in range(2)]
    own_blocks = []  # while the gather travels
    for index in range(2):
        own = _own(kv, index)
        own_blocks.append(block_forward(parts[index], own[0], own[1], CAUSAL, scale, blocks))
    _wait(work)
    outs, lses = [], []
    for index, chunk in enumerate(rank_chunks(rank, cp)):
        acc = None
        if chunk:
            earlier = torch.cat([_chunk(gathered, c, cp) for c in range(chunk)], dim=-2)
            acc = block_forward(parts[index], earlier[0], earlier[1], FULL, scale, blocks)
        out, lse = merge(acc, own_blocks[index])
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)
    return out.contiguous(), lse.contiguous(), kv  # the strides the fake declares


_forward = OpaqueWhenTraced("mega::gathered_attention_forward", _forward_body)


@_forward.op.register_fake
def _(q, k, v, group_name, rank, cp, scale, blocks):  # noqa: ANN001, ANN202
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return q.new_empty(q.shape), lse, k.new_empty((2, *k.shape))


def _backward_body(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group_name: str,
    rank: int,
    cp: int,
    scale: float,
    blocks: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in ``q``'s dtype."""
    group = _resolve_process_group(group_name)
    gathered, work = _start_gather(kv, group, cp)
    half = q.shape[2] // 2
    dgathered = torch.zeros_like(gathered, dtype=torch.float32)
    chunks = rank_chunks(rank, cp)
    inputs, own_grads = [], []
    for index, chunk in enumerate(chunks):  # the own blocks while the gather travels
        rows = slice(index * half, (index + 1) * half)
        args = (dout[:, :, rows], q[:, :, rows])
        saved = (out[:, :, rows], lse[:, :, rows])
        own = _own(kv, index)
        dq, dk, dv = block_backward(*args, own[0], own[1], *saved, CAUSAL, scale, blocks)
        _chunk(dgathered, chunk, cp).add_(torch.stack((dk, dv)))
        inputs.append((args, saved))
        own_grads.append(dq.float())  # summed over the blocks in float32
    _wait(work)
    dqs = []
    for index, chunk in enumerate(chunks):
        (args, saved), dq = inputs[index], own_grads[index]
        for earlier in range(chunk):  # one block per chunk: same sums as one wide block
            kv = _chunk(gathered, earlier, cp)
            dq_e, dk, dv = block_backward(*args, kv[0], kv[1], *saved, FULL, scale, blocks)
            dq = dq + dq_e
            _chunk(dgathered, earlier, cp).add_(torch.stack((dk, dv)))
        dqs.append(dq)
    dkv = dgathered.new_empty(dgathered.shape[1:])
    comm.reduce_scatter_into(dkv, dgathered.view(cp * 2, *dgathered.shape[2:]), group)
    dtype = q.dtype
    # copies: an op's outputs are not views of one another
    dk, dv = (x.to(dtype, copy=True) for x in dkv)
    return torch.cat(dqs, dim=-2).to(dtype), dk, dv


_backward = OpaqueWhenTraced("mega::gathered_attention_backward", _backward_body)


@_backward.op.register_fake
def _(dout, q, kv, out, lse, group_name, rank, cp, scale, blocks):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape), kv.new_empty(kv.shape[1:]), kv.new_empty(kv.shape[1:])


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, *args: Any):  # noqa: ANN001
        out, lse, kv = _forward(q, k, v, *args)
        # the local keys and values, gathered again in backward (as Transformer Engine does):
        # keeping every layer's whole-sequence copy until its backward would cost cp times more
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = args
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001
        q, kv, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, kv, out, lse, *ctx.args)
        return dq, dk, dv, *[None] * len(ctx.args)


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    rank: int,
    cp: int,
    scale: float,
    blocks: str = "auto",
) -> torch.Tensor:
    """Causal attention of this rank's queries ``q [b, h, s_local, d]`` over the whole sequence,
    whose keys and values ``[b, g, s_local, d]`` are split over ``group``: ``[b, h, s_local, d]``.
    ``blocks``: the attention kernel's block implementation (``mega.parallel.attention_kernels``)."""
    return _GatheredAttention.apply(q, k, v, group.group_name, rank, cp, scale, blocks)
