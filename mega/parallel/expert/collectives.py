"""Autograd collectives over the expert-parallel group, on dim 0 (rows of tokens).

| function          | forward                                | backward                        |
|-------------------|----------------------------------------|---------------------------------|
| ``gather_rows``   | all-gather (every rank's rows, in rank order) | reduce-scatter (own rows) |
| ``scatter_rows``  | reduce-scatter (sum, keep own rows)    | all-gather                      |
| ``exchange_rows`` | all-to-all with uneven row counts      | the reverse all-to-all          |

The first two are the tensor-parallel mappings' along dim 0 (:mod:`mega.parallel.tensor.mappings`).
All three are functional collectives (:mod:`mega.parallel.functional_comm`): compiled MoE layers
trace them correctly.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.functional_comm import all_to_all_rows
from mega.parallel.tensor.mappings import gather_along, reduce_scatter_along


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated in rank order (same row count on every rank)."""
    return x if group is None else gather_along(x, group, 0)


def scatter_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over the ranks; this rank keeps its ``1/size`` of the rows."""
    return x if group is None else reduce_scatter_along(x, group, 0)


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in order) go to rank ``r``; ``recv[r]`` rows arrive from it."""
    return x if group is None else _ExchangeRows.apply(x, send, recv, group)
