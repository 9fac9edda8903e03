"""Autograd collectives over the expert-parallel group, on dim 0 (rows of tokens).

| function          | forward                                | backward                        |
|-------------------|----------------------------------------|---------------------------------|
| ``gather_rows``   | all-gather (every rank's rows, in rank order) | reduce-scatter (own rows) |
| ``scatter_rows``  | reduce-scatter (sum, keep own rows)    | all-gather                      |
| ``exchange_rows`` | all-to-all with uneven row counts      | the reverse all-to-all          |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mega.parallel.comm import all_gather_into, group_size, reduce_scatter_into


def _gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x, group)
    return out


def _scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    reduce_scatter_into(out, x, group)
    return out


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter(grad, ctx.group), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.group), None


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated in rank order (same row count on every rank)."""
    return x if group is None else _GatherRows.apply(x, group)


def scatter_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks; this rank keeps its ``1/size`` of the rows."""
    return x if group is None else _ScatterRows.apply(x, group)


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in order) go to rank ``r``; ``recv[r]`` rows arrive from it."""
    return x if group is None else _ExchangeRows.apply(x, send, recv, group)
