"""Sequence parallelism's exposed collectives hidden behind the GEMMs, token block by token block
(what Megatron's ``--tp-comm-split-ag`` / ``--tp-comm-split-rs`` do through Transformer Engine's
userbuffers). Experimental, opt-in: ``MEGA_TP_SPLIT_OVERLAP=1``.

Under sequence parallelism each rank holds one block of the flat tokens (``[b*s/tp, h]``,
:mod:`mega.parallel.tensor.mappings`' layout). Three collectives sit between the GEMMs that need
them, with nothing beside them:

- column-parallel forward: all-gather the blocks, then ``Y = X W^T``. Split: start the gather,
  compute this rank's own block's rows (it has them), then the other blocks' rows as they arrive;
- row-parallel forward: ``Y = X W^T`` over all tokens, then reduce-scatter the rows. Split: compute
  the rows that belong to the other ranks first and send them (an all-to-all), compute this
  rank's own block meanwhile, then add what the others sent for it;
- row-parallel backward: all-gather dY, then ``dX = dY W``. Split: start the gather, compute the
  own block's rows of dX, then the others'; the weight gradient last, on the gathered dY.

(Column-parallel backward is already overlapped by :mod:`.overlapped`.) Each is one opaque
custom op under ``torch.compile`` so the order holds. What it costs: a GEMM becomes two or three
smaller ones and the host launches more. Without CUDA graphs the host cost lost (2 H200,
2026-11-28: TP2 + SP 0.94-0.98x of the unsplit step, in a version of this written then and not
kept); with ``--cuda-graph-impl local`` the launches are replayed, which is what this is for.

For two ranks the sums equal the reduce-scatter's (one addition of the same two values); for
more, the additions run in another order than NCCL's ring (bf16 rounding).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.parallel.comm import all_gather_into
from mega.parallel.distributed import peer_copies_possible
from mega.parallel.tensor import copy_engine_split
from mega.parallel.tensor.split_choice import COPY_ENGINE, SPLIT_ENV
from mega.parallel.weight_grad import OpaqueWhenTraced, weight_gradient


def by_copy_engine(group: object, like: torch.Tensor) -> bool:
    """``copy-engine`` asked for and possible (CUDA GPUs of one host, NCCL); elsewhere (CPU ranks,
    several hosts) the NCCL split runs."""
    return os.environ.get(SPLIT_ENV) == COPY_ENGINE and peer_copies_possible(group, like)


def _rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out = x weight^T (+ bias)``, written in place (a block of a larger output)."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def _others(x: torch.Tensor, rank: int, n: int) -> list[tuple[slice, torch.Tensor]]:
    """The row ranges of ``x`` (blocks of ``n``) that are not ``rank``'s, with their rows."""
    before, after = slice(0, rank * n), slice((rank + 1) * n, x.shape[0])
    return [(r, x[r]) for r in (before, after) if r.stop > r.start]


def _column_forward_body(
    x_2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str, size: int
) -> torch.Tensor:
    """``[n*size, out/tp]``: every rank's token block through this rank's columns."""
    group = _resolve_process_group(name)
    if by_copy_engine(group, x_2d):
        return copy_engine_split.column_forward(x_2d, weight, bias, group, _rows)
    rank, n = dist.get_rank(group), x_2d.shape[0]
    gathered = x_2d.new_empty(n * size, x_2d.shape[1])
    gathering = all_gather_into(gathered, x_2d, group, async_op=True)
    out = x_2d.new_empty(n * size, weight.shape[0])
    _rows(x_2d, weight, bias, out[rank * n : (rank + 1) * n])  # while the blocks travel
    gathering.wait()
    for rows, block in _others(gathered, rank, n):
        _rows(block, weight, bias, out[rows])
    return out


_column_forward = OpaqueWhenTraced("mega::column_split_forward", _column_forward_body)


@_column_forward.op.register_fake
def _(x_2d, weight, bias, name, size):  # noqa: ANN001, ANN202
    return x_2d.new_empty(x_2d.shape[0] * size, weight.shape[0])


def column_split_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str, size: int
) -> torch.Tensor:
    """``[b, s, out/tp]`` from this rank's token block ``x`` (``[b, s/tp, in]``): the gathered
    input's GEMM, the gather hidden behind the own block's rows. No autograd: the caller's
    function (:mod:`.overlapped`) has the backward."""
    out = _column_forward(x.reshape(-1, x.shape[-1]), weight, bias, name, size)
    return out.view(x.shape[0], -1, weight.shape[0])


def _row_forward_body(
    x_2d: torch.Tensor, weight: torch.Tensor, name: str, size: int
) -> torch.Tensor:
    """``[N/size, out]``: this rank's token block of ``sum over ranks of x_2d weight^T``."""
    group = _resolve_process_group(name)
    if by_copy_engine(group, x_2d):
        return copy_engine_split.row_forward(x_2d, weight, group)
    rank, n = dist.get_rank(group), x_2d.shape[0] // size
    send = x_2d.new_empty((size - 1) * n, weight.shape[0])
    start = 0
    for _, block in _others(x_2d, rank, n):  # the other ranks' rows first, in rank order
        _rows(block, weight, None, send[start : start + block.shape[0]])
        start += block.shape[0]
    received = torch.empty_like(send)
    splits = [0 if peer == rank else n for peer in range(size)]
    sending = dist.all_to_all_single(received, send, splits, splits, group=group, async_op=True)
    own = x_2d[rank * n : (rank + 1) * n].mm(weight.t())  # while the others' rows travel
    sending.wait()
    if size == 2:  # one addition of the same two values as the reduce-scatter's
        return own + received
    return own + received.view(size - 1, n, -1).sum(0)


_row_forward = OpaqueWhenTraced("mega::row_split_forward", _row_forward_body)


@_row_forward.op.register_fake
def _(x_2d, weight, name, size):  # noqa: ANN001, ANN202
    return x_2d.new_empty(x_2d.shape[0] // size, weight.shape[0])


def _row_backward_body(
    grad_out: torch.Tensor,
    x_2d: torch.Tensor,
    weight: torch.Tensor,
    name: str,
    size: int,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX ``[N, in/tp]``, dW or the fused placeholder) from this rank's block of dY."""
    group = _resolve_process_group(name)
    if by_copy_engine(group, grad_out):
        grad_x, gathered = copy_engine_split.row_backward_gather(grad_out, x_2d, weight, group)
    else:
        grad_x, gathered = _row_backward_gather(grad_out, x_2d, weight, group, size)
    return grad_x, weight_gradient(weight, gathered, x_2d, fused)


def _row_backward_gather(
    grad_out: torch.Tensor, x_2d: torch.Tensor, weight: torch.Tensor, group: object, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, the gathered dY) by NCCL: the own block's dX rows while dY travels."""
    rank, n = dist.get_rank(group), grad_out.shape[0]
    gathered = grad_out.new_empty(n * size, grad_out.shape[1])
    gathering = all_gather_into(gathered, grad_out, group, async_op=True)
    grad_x = x_2d.new_empty(x_2d.shape)
    torch.mm(grad_out, weight, out=grad_x[rank * n : (rank + 1) * n])  # while dY travels
    gathering.wait()
    for rows, block in _others(gathered, rank, n):
        torch.mm(block, weight, out=grad_x[rows])
    return grad_x, gathered


_row_backward = OpaqueWhenTraced("mega::row_split_backward", _row_backward_body)


@_row_backward.op.register_fake
def _(grad_out, x_2d, weight, name, size, fused):  # noqa: ANN001, ANN202
    return torch.empty_like(x_2d), torch.empty_like(weight)


class _RowParallelSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, name: str, size: int, fused: bool):  # noqa: ANN001
        x_2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_2d, weight)
        ctx.args = (name, size, fused)
        ctx.shape = x.shape
        out = _row_forward(x_2d, weight, name, size)
        return out.view(x.shape[0], -1, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        x_2d, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        grad_x, grad_weight = _row_backward(grad_2d, x_2d, weight, *ctx.args)
        return grad_x.view(ctx.shape), grad_weight, None, None, None


def row_split_linear(
    x: torch.Tensor, weight: torch.Tensor, name: str, size: int, fused: bool
) -> torch.Tensor:
    """``[b, s/tp, out]``: this rank's token block of the row-parallel GEMM's sum over ranks
    (``x``: ``[b, s, in/tp]``), reduce-scattered by blocks as the module docstring says; its
    backward gathers dY beside the own block's dX rows. ``fused``: the weight gradient goes to
    ``main_grad`` (:mod:`mega.parallel.weight_grad`)."""
    return _RowParallelSplit.apply(x, weight, name, size, fused)


def __getattr__(name: str) -> object:
    """``split_chosen`` and ``split_problem`` moved to :mod:`.split_choice` (2026-11-30): the old
    path works for a release, with a DeprecationWarning."""
    if name in ("split_chosen", "split_problem"):
        import warnings

        from mega.parallel.tensor import split_choice

        warnings.warn(
            f"mega.parallel.tensor.split_overlap.{name} is deprecated since 2026-11-30: use"
            f" 'from mega.parallel.tensor.split_choice import {name}'",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(split_choice, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
