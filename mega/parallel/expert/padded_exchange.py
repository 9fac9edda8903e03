"""The ``flex`` trips by one all-to-all of fixed splits each way: ``MEGA_FLEX_TRANSPORT=padded``.

The same contract as :mod:`mega.parallel.expert.split_exchange`'s (``dispatch_rows`` brings
``arrived`` expert-major with its ``layout``; ``combine_rows`` takes the
experts' rows back), carried another way. Every rank sends every rank a block of ``S`` rows (its
routed slots: all of them could go to one rank), its real rows first; the per-expert counts go
in a small all-to-all of their own; each side finds its rows by index maps computed on the
device from those counts. So no split is read on the host, no shape depends on the routing (a
compiled MoE layer with the grouped GEMM on GPUs is one graph; the expert loop reads its counts
anyway), it runs on any backend (NCCL, gloo) and any expert-parallel
group, and it needs no symmetric memory.

Why: torch's NVSHMEM kernels cost more per trip than NCCL's all-to-all (on 2 H200, 2026-11-30,
at 16,384 rows of 2048: 0.57 ms against 0.17 ms, ``benchmarks/flex_trips.py``), and a
write-after-read race is suspected in them when two streams overlap their trips (docs/moe.md;
in order, 600 probed trips were right). The price here is bytes: ``n`` times
the real rows cross (EP2 twice, EP4 four times), plus two gathers each way.

Every gather's gradient is the opposite gather (:class:`_Rows`): the maps are one-to-one between
the rows that carry a slot, and a row that carries none reads a zero row.

Every rank routes the same number of slots ``S`` (a micro-batch's tokens times ``k``, the same on
every rank of the group), as the NVSHMEM buffers assume too: the blocks' size is agreed without
asking.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.expert.collectives import exchange_rows
from mega.parallel.expert.copy_engine_exchange import (
    copy_engine_exchange,
    copy_engine_usable,
    peer_rows_exchange,
    peer_rows_usable,
)
from mega.parallel.functional_comm import start_exchange, wait

# Each expert's rows start at a multiple of 8 rows here (16 bytes of bf16): the grouped GEMM's
# kernel requires that of a group when the operand's rows are its contiguous dimension, and
# Inductor may lay a gradient out so (the weight gradient's ``grad.t()`` as a row-major buffer:
# ``delta % align`` asserted, 2 H200, torch 2.11, 2026-11-30). torchtitan aligns its groups alike.
GROUP_ALIGN = 8


def padded_offsets(sizes: torch.Tensor, n: int, local: int, align: int = 1) -> torch.Tensor:
    """Each expert-major block's first row as NVSHMEM lays them out (split_exchange's docstring): blocks
    one after another, each expert's room rounded up to ``align`` rows and at least ``align`` (an
    empty expert's padding, as NVSHMEM's kernel gives one)."""
    per_expert = sizes.view(local, n)
    totals = per_expert.sum(1)
    room = (torch.clamp(totals, min=1) + align - 1) // align * align
    starts = torch.cumsum(room, 0) - room
    within = torch.cumsum(per_expert, 1) - per_expert
    return (starts.unsqueeze(1) + within).reshape(-1)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]``, a zero row where ``index == len(x)`` (no copy of ``x`` with a zero row
    appended: one gather and one fill, both the size of the result, fused when compiled).

    The fill is out of place on purpose: torch 2.11's compile gives an autograd.Function whose
    forward returns a tensor filled in place a zero gradient (the padded transport's EP2 trained
    with its experts' gradients missing, 2 H200 and CPU, 2026-11-30; torch 2.13 is right)."""
    if x.shape[0] == 0:  # nothing to take: every row is a zero row
        return x.new_zeros(index.shape[0], x.shape[1])
    rows = x.index_select(0, index.clamp(max=x.shape[0] - 1))
    return rows.masked_fill((index == x.shape[0]).unsqueeze(1), 0)


class _Rows(torch.autograd.Function):
    """``out[i] = x[index[i]]``, a zero row where ``index[i] == len(x)``; backward the opposite
    gather by ``back`` (``back[j] == len(out)`` for a row of ``x`` no output takes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return _take(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return _take(grad, back), None, None


def _blocks(
    x: torch.Tensor, group: Any, n: int, real: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """``x``'s ``n`` equal blocks of rows, block ``q`` to rank ``q``: by the copy engine where
    ``MEGA_FLEX_TRANSPORT=copy-engine`` can use it (:mod:`.copy_engine_exchange`), by a kernel
    writing block ``q``'s first ``real[0][q]`` rows where ``peer-rows`` can (``real[1][q]``: the
    real rows of the block from ``q``), else by the group's all-to-all."""
    if real is not None and peer_rows_usable(group, x):
        return peer_rows_exchange(x, real[0], real[1], group.group_name)
    if copy_engine_usable(group, x):
        return copy_engine_exchange(x, group.group_name)
    rows = x.shape[0] // n
    return exchange_rows(x, [rows] * n, [rows] * n, group)


def _count_at_or_below(bounds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``torch.searchsorted(bounds, values, right=True)`` for ascending ``bounds`` (batched along
    the leading dimension when 2-D), as a comparison count: torch 2.11's Inductor fails to lower
    ``searchsorted`` whose boundaries are a view (``NotImplementedError: View`` on 2 H200,
    2026-11-30), and the bounds here are a few dozen rank or expert ends, so counting is cheap."""
    return (values.unsqueeze(-1) >= bounds.unsqueeze(-2)).sum(-1)


def _send_maps(splits: torch.Tensor, n: int, local: int, s: int) -> tuple[torch.Tensor, ...]:
    """Between a rank's ``S`` sorted rows and its send buffer ``[n * S]`` (block ``r``: the rows
    for rank ``r``, then padding): ``(into, out_of)``, ``into[p]`` the row that fills place
    ``p`` (``S``: none) and ``out_of[i]`` the place of row ``i``."""
    sent = splits.view(n, local).sum(1)
    ends = torch.cumsum(sent, 0)
    starts = ends - sent
    j = torch.arange(s, device=splits.device)
    into = torch.where(j < sent.unsqueeze(1), starts.unsqueeze(1) + j, s).reshape(-1)
    rank = _count_at_or_below(ends, j).clamp(max=n - 1)
    return into, rank * s + j - starts.index_select(0, rank)


def _arrival_maps(counts: torch.Tensor, n: int, local: int, s: int) -> tuple[torch.Tensor, ...]:
    """Between the received blocks ``[n * S]`` (block ``q``: source ``q``'s rows for this rank's
    experts in expert order, then padding; ``counts [n, local]`` their rows per expert) and the
    expert-major arrival ``[n * S + local * GROUP_ALIGN]``: ``(into, out_of, layout)``, ``into[o]`` the
    received row at arrival row ``o`` (``n * S``: none), ``out_of[p]`` the arrival row of
    received row ``p`` (``n * S + local * GROUP_ALIGN``: none) and the layout (sizes and first rows of the
    blocks at ``expert * n + source``, each expert's room a multiple of ``GROUP_ALIGN`` rows
    and an empty expert's ``GROUP_ALIGN`` rows of padding)."""
    device, rows = counts.device, n * s + local * GROUP_ALIGN
    sizes = counts.t().reshape(-1)
    starts = padded_offsets(sizes, n, local, GROUP_ALIGN)
    ends = torch.cumsum(counts, 1)
    within = ends - counts  # [source, expert]: where the expert's rows begin in the block
    o = torch.arange(rows, device=device)
    # the block holding arrival row o is the last to start at or before it (an empty block
    # starting where a full one does comes first in expert-major order)
    block = (_count_at_or_below(starts, o) - 1).clamp(min=0)
    offset = o - starts.index_select(0, block)
    expert, source = block // n, block % n
    held = offset < sizes.index_select(0, block)
    into = torch.where(held, source * s + within[source, expert] + offset, n * s)
    j = torch.arange(s, device=device).expand(n, s).contiguous()
    expert_of = _count_at_or_below(ends, j).clamp(max=local - 1)
    source_of = torch.arange(n, device=device).unsqueeze(1).expand(n, s)
    block_of = expert_of * n + source_of
    place = starts.index_select(0, block_of.reshape(-1)).view(n, s) + j
    place = place - within.gather(1, expert_of)
    out_of = torch.where(j < ends[:, -1:], place, rows).reshape(-1)
    return into, out_of, torch.stack([sizes, starts])


class _Begun(torch.autograd.Function):
    """The all-to-all of equal blocks begun (:func:`start_exchange`): its result must not be
    read before :class:`_Ended` waits for it. Backward, the wait for the gradient's all-to-all
    that :class:`_Ended`'s backward began: so the backward runs each trip's reverse as the same
    begun/ended pair, in the reverse order, the autograd engine running what came between them
    in the forward (the other chunk's experts) between them again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, name: str) -> torch.Tensor:
        return start_exchange(x, n, name)

    @staticmethod
    def backward(ctx, pending: torch.Tensor):
        return wait(pending), None, None


class _Ended(torch.autograd.Function):
    """The wait for a :class:`_Begun` all-to-all; backward, the reverse all-to-all begun (equal
    blocks: the same exchange)."""

    @staticmethod
    def forward(ctx, pending: torch.Tensor, n: int, name: str) -> torch.Tensor:
        ctx.n, ctx.name = n, name
        return wait(pending)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return start_exchange(grad, ctx.n, ctx.name), None, None


def dispatch_begin(
    rows: torch.Tensor, splits: torch.Tensor, name: str, n: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dispatch` begun: ``(rows, counts)`` on their way (over group ``name``), for
    :func:`dispatch_end`; in between the caller does other work (the pipelined schedule of
    ``mega.parallel.expert.flex_schedule``: another chunk's experts)."""
    s = rows.shape[0]
    torch._assert_async(splits.sum() == s)
    into, out_of = _send_maps(splits, n, local, s)
    pending = _Begun.apply(_Rows.apply(rows, into, out_of), n, name)
    return pending, start_exchange(splits.view(n, local), n, name)


def dispatch_end(
    begun: tuple[torch.Tensor, torch.Tensor], name: str, n: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dispatch`'s ``(arrived, layout)`` from what :func:`dispatch_begin` began."""
    pending, counts = begun
    received = _Ended.apply(pending, n, name)
    into, out_of, layout = _arrival_maps(wait(counts), n, local, received.shape[0] // n)
    return _Rows.apply(received, into, out_of), layout


def combine_begin(
    outputs: torch.Tensor, layout: torch.Tensor, name: str, n: int, local: int
) -> torch.Tensor:
    """:func:`combine` begun: the experts' rows on their way back, for :func:`combine_end`."""
    s = (outputs.shape[0] - local * GROUP_ALIGN) // n
    into, out_of, _ = _arrival_maps(layout[0].view(local, n).t(), n, local, s)
    return _Begun.apply(_Rows.apply(outputs, out_of, into), n, name)


def combine_end(
    pending: torch.Tensor, splits: torch.Tensor, name: str, n: int, local: int
) -> torch.Tensor:
    """:func:`combine`'s ``[S, h]`` from what :func:`combine_begin` began (``splits`` this
    rank's own)."""
    back = _Ended.apply(pending, n, name)
    into, out_of = _send_maps(splits, n, local, back.shape[0] // n)
    return _Rows.apply(back, out_of, into)


def dispatch(
    rows: torch.Tensor, splits: torch.Tensor, group: Any, n: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(arrived [n * S + local * GROUP_ALIGN, h], layout [2, n * local])``: ``split_exchange.dispatch_rows``'s
    contract by fixed splits."""
    s = rows.shape[0]
    # every row goes somewhere (dropless): rows the splits did not count would be lost quietly
    torch._assert_async(splits.sum() == s)
    into, out_of = _send_maps(splits, n, local, s)
    send = _Rows.apply(rows, into, out_of)
    counts = _blocks(splits.view(n, local), group, n)  # first: peer-rows sends by them
    received = _blocks(send, group, n, real=(splits.view(n, local).sum(1), counts.sum(1)))
    into, out_of, layout = _arrival_maps(counts, n, local, s)
    return _Rows.apply(received, into, out_of), layout


def combine(
    outputs: torch.Tensor,
    layout: torch.Tensor,
    splits: torch.Tensor,
    group: Any,
    n: int,
    local: int,
) -> torch.Tensor:
    """``[S, h]``: the blocks of ``outputs`` back to the ranks they came from, in the order they
    left (``splits`` this rank's own, as it sent them); ``split_exchange.combine_rows``'s
    contract by fixed splits."""
    s = (outputs.shape[0] - local * GROUP_ALIGN) // n
    counts = layout[0].view(local, n).t()
    into, out_of, _ = _arrival_maps(counts, n, local, s)
    real = (counts.sum(1), splits.view(n, local).sum(1))  # each source's rows go back to it
    back = _blocks(_Rows.apply(outputs, out_of, into), group, n, real=real)
    into, out_of = _send_maps(splits, n, local, s)
    return _Rows.apply(back, out_of, into)
