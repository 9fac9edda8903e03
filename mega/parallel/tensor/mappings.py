"""Autograd-aware collectives over the tensor-parallel group (Megatron's ``mappings.py``).

Each function is one collective in forward and its adjoint in backward:

| function                       | forward                  | backward                  |
|--------------------------------|--------------------------|---------------------------|
| ``copy_to_tensor_parallel``    | identity                 | all-reduce                |
| ``reduce_from_tensor_parallel``| all-reduce               | identity                  |
| ``gather_from_tensor_parallel``| all-gather along ``dim`` | keep own slice            |
| ``scatter_to_sequence``        | keep own token block     | all-gather                |
| ``gather_from_sequence``       | all-gather               | reduce-scatter            |
| ``gather_sequence_replicated`` | all-gather               | keep own token block      |
| ``reduce_scatter_to_sequence`` | reduce-scatter           | all-gather                |
| ``gather_along`` (any dim)     | all-gather               | reduce-scatter            |
| ``reduce_scatter_along``       | reduce-scatter           | all-gather                |

Activations are batch-first ``[b, s, h]``. Under sequence parallelism a rank holds ``1/tp`` of the
tokens as ``[b, s/tp, h]``: block ``r`` of the ``b * s`` tokens in memory order (Megatron's
``[s, b, h]`` layout gives each rank a slice of every sample's sequence instead). The sequence-
parallel region runs token-wise ops only (norms, dropout, residual adds, biases, the router), so
which tokens a rank holds does not change the result; a block of the flat tokens is contiguous on
both sides of a collective, where a slice along dim 1 costs a strided copy before each gather and
reduce-scatter and after each (every consumer of the gathered ``[s, b, h]`` view copies it again):
35% of a 1.3B GPT's TP2 step on one H200. The collectives work on dim 0; ``group`` None means a
group of one: every function is then the identity. The collectives are the functional ones
(:mod:`mega.parallel.functional_comm`), which ``torch.compile`` traces correctly, so tensor-
parallel layers compile; their results never alias the inputs (the incoming tensor may be shared
with another autograd branch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mega.parallel.comm import group_size
from mega.parallel.functional_comm import all_gathered, all_reduced, reduce_scattered


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return (
        x.clone(memory_format=torch.contiguous_format) if group is None else all_reduced(x, group)
    )


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (group order)."""
    size = group_size(group)
    if size == 1:
        return x
    out = all_gathered(x if dim == 0 else x.movedim(dim, 0), group)
    return out if dim == 0 else out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} does not split over {size} ranks")
    out = reduce_scattered(x if dim == 0 else x.movedim(dim, 0), group)
    return out if dim == 0 else out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(
            f"dim {dim} of shape {tuple(x.shape)} does not split over {size} ranks "
            "(under --sequence-parallel the sequence length must divide by the TP size)"
        )
    return x.chunk(size, dim=dim)[_rank(group)].contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new autograd node, same storage

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split(grad, ctx.dim, ctx.group), None, None


def _flat_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, s, ...]`` as ``[b * s, ...]`` (a view of a contiguous tensor), after checking that
    the sequence splits over the group."""
    size = group_size(group)
    if x.shape[1] % size:
        raise ValueError(
            f"dim 1 of shape {tuple(x.shape)} does not split over {size} ranks "
            "(under --sequence-parallel the sequence length must divide by the TP size)"
        )
    return x.reshape(-1, *x.shape[2:])


def _as_sequences(flat: torch.Tensor, batch: int) -> torch.Tensor:
    return flat.view(batch, -1, *flat.shape[1:])


# The token collectives reshape inside their autograd functions, where no autograd node is
# recorded for the views: TP layers run eager, and there every node costs host time.
def _token_block(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _as_sequences(_split(_flat_tokens(x, group), 0, group), x.shape[0])


def _gather_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _as_sequences(_all_gather(x.reshape(-1, *x.shape[2:]), 0, group), x.shape[0])


def _reduce_scatter_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _as_sequences(_reduce_scatter(_flat_tokens(x, group), 0, group), x.shape[0])


TokenCollective = Callable[[torch.Tensor, Any], torch.Tensor]


def _token_function(
    name: str, forward: TokenCollective, backward: TokenCollective
) -> type[torch.autograd.Function]:
    """An autograd function of ``(x, group)`` that runs ``forward`` and whose gradient is
    ``backward`` of the incoming gradient (the table in the module's docstring)."""

    def run_forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    methods = {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)}
    return type(name, (torch.autograd.Function,), methods)


_ScatterToSequence = _token_function("_ScatterToSequence", _token_block, _gather_tokens)
_GatherFromSequence = _token_function("_GatherFromSequence", _gather_tokens, _reduce_scatter_tokens)
_GatherSequenceReplicated = _token_function(
    "_GatherSequenceReplicated", _gather_tokens, _token_block
)
_ReduceScatterToSequence = _token_function(
    "_ReduceScatterToSequence", _reduce_scatter_tokens, _gather_tokens
)


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank used the whole gathered tensor: the gradient of this rank's slice is the
        # sum of every rank's gradient for that slice.
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def gather_along(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank order); reduce-scatter backward."""
    return _GatherAlong.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """``x`` summed over the ranks, this rank's slice along ``dim``; all-gather backward."""
    return _ReduceScatterAlong.apply(x, dim, group)


def copy_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of dX backward."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Concatenate the shards of ``x`` along ``dim`` (e.g. vocab-parallel logits, inference)."""
    return _GatherFromTensorParallel.apply(x, dim % x.dim(), group)


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, s, h]`` replicated -> this rank's ``[b, s/tp, h]`` token block; all-gather backward."""
    return x if group is None else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, s/tp, h]`` -> ``[b, s, h]`` on every rank; reduce-scatter backward."""
    return x if group is None else _GatherFromSequence.apply(x, group)


def gather_sequence_replicated(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[b, s/tp, h]`` -> ``[b, s, h]`` for code every rank runs alike (BERT's pooler): the
    backward keeps this rank's block of the gradient instead of summing over the ranks."""
    return x if group is None else _GatherSequenceReplicated.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Partial sums ``[b, s, h]`` -> this rank's summed ``[b, s/tp, h]``; all-gather backward."""
    return x if group is None else _ReduceScatterToSequence.apply(x, group)
