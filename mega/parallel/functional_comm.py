"""Out-of-place collectives for code that ``torch.compile`` traces: the model's own
communication (tensor-parallel mappings, the vocab-parallel loss, the expert all-to-all).

They are PyTorch's functional collectives (``torch.distributed._functional_collectives``): each
returns a new tensor and writes into nothing, so a traced graph sees a pure function of its
input followed by a ``wait_tensor``, and inductor may move the wait to where the result is first
used. The in-place c10d calls (``dist.all_reduce`` on a clone, ``all_gather_into_tensor`` into a
buffer, ``all_to_all_single`` into a buffer) are correct in eager but were mis-traced inside
compiled layers on GPUs: on 2 H100 (torch 2.11) a compiled TP2 1.3B GPT had a first gradient
norm of 0.387 where eager TP2 and DP2 had 5.66, and a compiled EP2 MoE 3.19 where eager had 5.67;
through these functions both matched eager. On the CPU (gloo) the old calls traced correctly,
so only the GPU test (``tests/test_gpu_compiled_parallel.py``) tells the two apart.

Eager, a functional collective returns an ``AsyncCollectiveTensor`` that waits at its first use;
these functions wait at once (on CUDA: the current stream waits for NCCL's, the host does not),
so callers, autograd functions included, only ever hold plain tensors. Traced, funcol has
already put the wait into the graph. Every function takes a group of more than one rank.

:func:`start_all_gather` and :func:`wait` are the all-gather split in two, taking the group by
name, for code that holds a name rather than a group (``mega.parallel.tensor.overlapped``, whose
backward is a custom op that names its group): the raw ``_c10d_functional`` ops.
:func:`start_exchange` is the all-to-all of equal blocks split so (the ``flex`` dispatcher's
pipelined trips, ``mega.parallel.expert.flex_schedule.pipelined``). Compiled, inductor's default
schedule puts such a wait right after its collective wherever the code waits; its
``sink_waits`` pass moves it to the first use (``flex_schedule.PIPELINED_COMPILE_OPTIONS``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

# torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to *_single and warns on the old
# names; 2.11 has only the old ones
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_reduced(x: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    """``x`` reduced (``"sum"``, ``"max"``...) over ``group``, as a new tensor."""
    return _waited(funcol.all_reduce(x.contiguous(), op, group))


def all_gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in group order."""
    return _waited(_ALL_GATHER(x.contiguous(), 0, group))


def reduce_scattered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``; this rank's ``1/size`` of dim 0."""
    return _waited(_REDUCE_SCATTER(x.contiguous(), "sum", 0, group))


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in order) to rank ``r``; ``recv[r]`` rows arrive from it.

    Untraced (the ``alltoall`` MoE dispatcher runs eager inside a compiled layer) it is c10d's
    call into a new buffer: the functional collective's Python costs 143-192 us of host time
    against c10d's 27-34 us (2 H100, 2026-11-27), and the dispatch is host-bound."""
    if torch.compiler.is_compiling():
        return _waited(funcol.all_to_all_single(x.contiguous(), recv, send, group))
    out = x.new_empty((sum(recv), *x.shape[1:]))
    torch.distributed.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


_OPS = torch.ops._c10d_functional


def group_name(group: Any) -> str:
    """The name :func:`start_all_gather` takes for ``group`` (resolve it outside traced code)."""
    return group.group_name


def start_all_gather(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """Begin concatenating every rank's ``x`` along dim 0 over group ``name`` of ``size`` ranks."""
    return _OPS.all_gather_into_tensor(x.contiguous(), size, name)


def start_exchange(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """Begin an all-to-all of ``size`` equal blocks of ``x``'s rows over group ``name`` (block
    ``r`` to rank ``r``, rank ``r``'s block to place ``r``)."""
    rows = [x.shape[0] // size] * size
    return _OPS.all_to_all_single(x.contiguous(), rows, rows, name)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The result of :func:`start_all_gather` or :func:`start_exchange` (on CUDA the current
    stream waits, not the host)."""
    return _OPS.wait_tensor(t)
