"""Tensor parallelism's all-reduces (no sequence parallelism) by the copy engine, by row chunks:
``MEGA_TP_SPLIT_OVERLAP=copy-engine`` with ``--tensor-model-parallel-size > 1`` and no
``--sequence-parallel`` (experimental, opt-in; GPUs of one host).

Without sequence parallelism every rank holds every token, and two GEMMs per linear pair need
an all-reduce: the row-parallel forward's output (``Y = sum_r X_r W_r^T``) and the column-
parallel backward's input gradient (``dX = sum_r dY_r W_r``). NCCL's all-reduce needs SMs and,
under CUDA graphs (2 H200, 1.3B GPT, micro-batch 4, 2026-11-30), TP2 ran at 0.817x DP2 where
TP2 + SP with its collectives by the copy engine (:mod:`.copy_engine_split`) ran at 0.907x.

Here the GEMM runs in row chunks; as each chunk is done, the copy engine copies it into every
peer's inbox (symmetric memory, :mod:`.copy_engine_split`'s transport and signals) while the SMs
compute the next chunk (forward) or the weight gradient (backward). Each rank then adds what
arrived to its own chunk, out of place (its own chunk may still be on its way out). Every rank
sends its whole partial product to every peer, (size - 1) x the output's bytes, where NCCL's ring
sends 2 (size - 1) / size x: the same at two ranks, twice as much at four (TP2 is what this is
for).

The sums are the same on every rank, as NCCL's are: at two ranks one addition of the same two
values (commutative); at more, in rank order after every chunk has arrived.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.parallel.tensor import copy_engine_split, split_overlap
from mega.parallel.weight_grad import OpaqueWhenTraced, weight_gradient

# row chunks of a GEMM: the last chunk's copy is exposed; more chunks hide more of it, each at
# the cost of a smaller GEMM and four signal kernels (~4-8 us each on H200, two of them on the
# compute stream)
CHUNKS = 2


def _chunks(rows: int) -> list[slice]:
    """``rows`` as up to :data:`CHUNKS` contiguous ranges."""
    count = max(1, min(CHUNKS, rows))
    bounds = [rows * c // count for c in range(count + 1)]
    return [slice(bounds[c], bounds[c + 1]) for c in range(count)]


def _send_chunk(group: Any, direction: str, chunk: torch.Tensor) -> Any:
    """``chunk`` (this rank's partial sum of some rows) into every peer's inbox."""
    inbox = copy_engine_split.inbox_for(group, direction, chunk)
    copy_engine_split.send_blocks(inbox, dict.fromkeys(inbox.peers, chunk))
    return inbox


def _sum_arrived(inbox: Any, own: torch.Tensor, out: torch.Tensor) -> None:
    """``out = sum over ranks`` of the chunk, ``own`` this rank's, the others' from the inbox."""
    size, me = inbox.handle.world_size, inbox.handle.rank
    if size == 2:

        def add(q: int, block: torch.Tensor) -> None:
            torch.add(own, block, out=out)

        copy_engine_split.receive(inbox, own, add)
        return
    blocks = {me: own}

    def keep(q: int, block: torch.Tensor) -> None:
        blocks[q] = block.clone()  # out of the inbox before its slot is given back

    copy_engine_split.receive(inbox, own, keep)
    torch.add(blocks[0], blocks[1], out=out)
    for q in range(2, size):  # rank order: every rank the same bits
        out.add_(blocks[q])


def _all_reduced_rows(
    partial: Any, like: torch.Tensor, features: int, group: Any, direction: str, beside: Any = None
) -> tuple[torch.Tensor, Any]:
    """``[rows of like, features]`` summed over the group (``like``'s dtype and device), where
    ``partial(chunk, out)`` writes this rank's partial sum of a row range into ``out``; each
    chunk leaves as soon as it is written, ``beside()`` runs (its result returned) while the
    last ones travel."""
    rows = like.shape[0]
    own, out = like.new_empty(rows, features), like.new_empty(rows, features)
    chunks = _chunks(rows)
    inboxes = []
    for c, chunk in enumerate(chunks):
        partial(chunk, own[chunk])
        inboxes.append(_send_chunk(group, f"{direction}-{c}", own[chunk]))
    besides = beside() if beside is not None else None
    for inbox, chunk in zip(inboxes, chunks, strict=True):
        _sum_arrived(inbox, own[chunk], out[chunk])
    return out, besides


def _row_forward_body(x_2d: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """``[N, out]``: ``sum over ranks of x_2d weight^T``, on every rank."""
    group = _resolve_process_group(name)
    if not split_overlap.by_copy_engine(group, x_2d):  # CPU ranks, several hosts
        out = x_2d.mm(weight.t())
        dist.all_reduce(out, group=group)
        return out

    def partial(chunk: slice, out: torch.Tensor) -> None:
        torch.mm(x_2d[chunk], weight.t(), out=out)

    return _all_reduced_rows(partial, x_2d, weight.shape[0], group, "row-reduce")[0]


_row_forward = OpaqueWhenTraced("mega::row_reduce_forward", _row_forward_body)


@_row_forward.op.register_fake
def _(x_2d, weight, name):  # noqa: ANN001, ANN202
    return x_2d.new_empty(x_2d.shape[0], weight.shape[0])


def _row_backward_body(
    grad_2d: torch.Tensor, x_2d: torch.Tensor, weight: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, dW or the fused placeholder): dY is on every rank, nothing to communicate."""
    return grad_2d.mm(weight), weight_gradient(weight, grad_2d, x_2d, fused)


_row_backward = OpaqueWhenTraced("mega::row_reduce_backward", _row_backward_body)


@_row_backward.op.register_fake
def _(grad_2d, x_2d, weight, fused):  # noqa: ANN001, ANN202
    return torch.empty_like(x_2d), torch.empty_like(weight)


class _RowParallelReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, name: str, fused: bool):  # noqa: ANN001
        x_2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_2d, weight)
        ctx.fused, ctx.shape = fused, x.shape
        return _row_forward(x_2d, weight, name).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        x_2d, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        grad_x, grad_weight = _row_backward(grad_2d, x_2d, weight, ctx.fused)
        return grad_x.view(ctx.shape), grad_weight, None, None


def row_reduce_linear(
    x: torch.Tensor, weight: torch.Tensor, name: str, fused: bool
) -> torch.Tensor:
    """``[..., out]``: the row-parallel GEMM's sum over the group ``name`` (``x``: ``[..., in/tp]``),
    all-reduced by the copy engine chunk by chunk as the module docstring says. ``fused``: the
    weight gradient goes to ``main_grad`` (:mod:`mega.parallel.weight_grad`)."""
    return _RowParallelReduce.apply(x, weight, name, fused)


def column_backward(
    grad_2d: torch.Tensor, x_2d: torch.Tensor, weight: torch.Tensor, group: Any, wgrad: Any
) -> tuple[torch.Tensor, Any]:
    """The column-parallel backward without sequence parallelism: ``dX = dY W`` summed over the
    ranks, its chunks travelling while the next chunk and then ``wgrad(dY, X)`` are computed."""

    def partial(chunk: slice, out: torch.Tensor) -> None:
        torch.mm(grad_2d[chunk], weight, out=out)

    def beside() -> Any:
        return wgrad(grad_2d, x_2d)

    return _all_reduced_rows(partial, x_2d, weight.shape[1], group, "column-reduce", beside)
