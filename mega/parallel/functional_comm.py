"""Out-of-place collectives for code that ``torch.compile`` traces: the model's own
communication (tensor-parallel mappings, the vocab-parallel loss, the expert all-to-all).

Each is a custom op (``mega::all_gather``, ``mega::reduce_scatter``, ``mega::all_reduce``,
``mega::all_to_all``) that allocates its result and runs c10d's collective into it: a traced
graph sees a pure function of its input, opaque, that the compiler neither looks into nor
reorders across its data dependencies. On CUDA the compute stream waits for NCCL's (c10d's
synchronous form), the host does not.

Why not the in-place c10d calls (``dist.all_reduce`` on a clone, ``all_gather_into_tensor`` into
a buffer) straight in the model: they are correct in eager but were mis-traced inside compiled
layers on GPUs (2 H100, torch 2.11: a compiled TP2 1.3B GPT had a first gradient norm of 0.387
where eager TP2 and DP2 had 5.66; a compiled EP2 MoE 3.19 where eager had 5.67). On the CPU
(gloo) they traced correctly, so only the GPU test (``tests/test_gpu_compiled_parallel.py``)
tells the two apart. Inside an op, dynamo never traces them.

Why not PyTorch's functional collectives (``torch.distributed._functional_collectives``), which
also trace correctly and were these functions until session 32: their host cost. On an H100
host (torch 2.11) an all-gather and its ``wait_tensor`` took 143-192 us of CPU time per call
where c10d's took 27-34 us; a compiled TP2 + SP layer at micro-batch 4 issues ~10 collectives
per micro-batch, and that layout was host-bound (``docs/performance.md``). Through these ops a
call costs c10d's plus one custom-op dispatch.

Every function takes a group of more than one rank, or (``*_by_name``) its ``group_name``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.parallel.comm import all_gather_into, reduce_scatter_into

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def group_name(group: Any) -> str:
    """The name the ``*_by_name`` functions take for ``group`` (resolve it outside traced code)."""
    return group.group_name


@torch.library.custom_op("mega::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=_REDUCE_OPS[op], group=_resolve_process_group(name))
    return out


@_all_reduce.register_fake
def _(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mega::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    all_gather_into(out, x.contiguous(), _resolve_process_group(name))
    return out


@_all_gather.register_fake
def _(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] * size, *x.shape[1:]))


@torch.library.custom_op("mega::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), _resolve_process_group(name))
    return out


@_reduce_scatter.register_fake
def _(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0] // size, *x.shape[1:]))


@torch.library.custom_op("mega::all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], name: str) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    group = _resolve_process_group(name)
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


@_all_to_all.register_fake
def _(x: torch.Tensor, send: list[int], recv: list[int], name: str) -> torch.Tensor:
    return x.new_empty((sum(recv), *x.shape[1:]))


def all_reduced(x: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    """``x`` reduced (``"sum"``, ``"max"``, ``"min"``) over ``group``, as a new tensor."""
    return _all_reduce(x, op, group_name(group))


def all_gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in group order."""
    return all_gathered_by_name(x, group.size(), group_name(group))


def all_gathered_by_name(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """:func:`all_gathered` over the group ``name`` of ``size`` ranks."""
    return _all_gather(x, size, name)


def reduce_scattered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``; this rank's ``1/size`` of dim 0."""
    return _reduce_scatter(x, group.size(), group_name(group))


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in order) to rank ``r``; ``recv[r]`` rows arrive from it."""
    return _all_to_all(x, list(send), list(recv), group_name(group))
