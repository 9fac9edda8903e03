"""The padded trips' equal blocks by the copy engine: ``MEGA_FLEX_TRANSPORT=copy-engine``.

The padded transport (:mod:`mega.parallel.expert.padded_exchange`) sends every rank of the
expert-parallel group a block of the same size; this carries those blocks instead of NCCL's
all-to-all where the group's GPUs share a host: each rank copies its block for rank ``q`` into
``q``'s inbox in symmetric memory (peer-mapped: the copy engine moves it, no SM taken from the
GEMMs), and reads what arrived in its own.

Why: on 2 H200 an in-order flex EP2 step spent 71 ms of ~230 in its padded trips (2026-11-30,
c1c71fd): each carried twice the real rows at NCCL's point-to-point rate (~100 GB/s a
direction), where the copy engine moved 32-64 MiB rank to rank in a ring of 4 H200 at 203-257
GB/s (``collectives_ring_4gpu_h200_2026-11-28.json``, the CP ring's copy lane). Measured since
(2 H200, 2026-11-30, session 50): right, and no faster than NCCL's trips (EP2 0.883x DP2
against 0.875x): after the communicator fix a trip mostly waits for the other rank, so ``auto``
keeps NCCL (docs/moe.md). Under CUDA graphs (``--cuda-graph-impl local``, session 54) the host's
skew is gone and the trips are transfer-bound: whole blocks by the copy engine 0.944x DP2
against NCCL's 0.932x, the real rows only (``peer-rows``, below) 0.958-0.976x.

Each trip goes through the group's inbox of :mod:`mega.parallel.tensor.copy_engine_split` (a
slot per sending rank in symmetric memory, *ready* and *free* tokens per peer, made by a
rendezvous on a warm-up step, never inside a CUDA graph's capture): on the inbox's side stream,
after what the current stream queued, for every peer ``q`` wait for its *free* token, copy the
block into slot ``me`` of ``q``'s inbox, put a *ready* token; meanwhile the current stream copies
this rank's own block into the result, then for every peer waits for its *ready* token, copies
its block out of the own inbox and puts a *free* token back. Tokens are symmetric memory's
signals (a put waits for the flag to be clear, a wait clears it), so a trip ends with every
token where it began and a CUDA graph replays it as captured (``--cuda-graph-impl local``); the
signals, not the streams, order the trips. Every rank makes the inbox with the same sizes (every
rank routes the same number of slots); a larger trip makes a larger one.

Backward: an all-to-all of equal blocks is its own reverse (block ``q`` of the gradient goes
back to rank ``q``), so the gradient takes the same trip. A custom op, so a compiled MoE layer
stays one graph with the trip opaque in it.

``MEGA_FLEX_TRANSPORT=peer-rows`` (:func:`peer_rows_exchange`): the same trips and tokens, but
each block's real rows only (they come first in a padded block; their number per peer is on the
device, from the routing) written into the peer's inbox by a kernel
(:mod:`.peer_rows_kernel`) instead of the whole block by the copy engine: the padding never
crosses (EP2 sends half the bytes of the padded trips). The rows past the real ones in what
arrives are whatever the inbox held: the padded maps never read them (a row that carries no
slot reads a zero row, ``padded_exchange._take``). Its gradient takes the same trip with the
counts swapped (what arrived from ``q`` goes back to ``q``).
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.distributed import peer_copies_possible
from mega.parallel.expert.validate import flex_transport

COPY_ENGINE = "copy-engine"  # MEGA_FLEX_TRANSPORT's values
PEER_ROWS = "peer-rows"
_DIRECTION = "flex"  # the trips' inbox, one per group (copy_engine_split's inboxes)


def _trip(
    x: torch.Tensor, group: Any, real: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Block ``q`` of ``x`` (its rows cut in ``group``'s size equal blocks) to rank ``q``; the
    blocks every rank sent here, in rank order. With ``real`` (``send_rows, recv_rows``, each
    ``[group size]`` on the device) only the first ``send_rows[q]`` rows of block ``q`` cross,
    by a kernel, and only the first ``recv_rows[q]`` of what arrived from ``q`` are copied out
    (the rest of the result is left unwritten)."""
    from mega.parallel.tensor.copy_engine_split import inbox_for, receive, send_blocks

    n = torch.distributed.get_world_size(group)
    x = x.contiguous()
    blocks = x.view(n, x.shape[0] // n, *x.shape[1:]).unbind(0)
    inbox = inbox_for(group, _DIRECTION, blocks[0])
    out = torch.empty_like(x)  # contiguous, as the fake says
    arrived = out.view(n, *blocks[0].shape).unbind(0)

    def send(q: int, slot: torch.Tensor, block: torch.Tensor) -> None:
        _copy(slot, block, real, 0, q)

    def take(q: int, slot: torch.Tensor) -> None:
        _copy(arrived[q], slot, real, 1, q)

    send_blocks(inbox, {q: blocks[q] for q in inbox.peers}, send)
    me = inbox.handle.rank
    _copy(arrived[me], blocks[me], real, 0, me)  # while the others' blocks travel
    receive(inbox, blocks[0], take)
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, real: tuple | None, which: int, q: int) -> None:
    """One block ``src`` into ``dst``: whole (the copy engine), or with ``real`` its first
    ``real[which][q]`` rows by a kernel that reads that count on the device."""
    if real is None:
        dst.copy_(src)
    elif src.numel():
        from mega.parallel.expert.peer_rows_kernel import copy_first_rows

        copy_first_rows(dst, src, real[which][q:])


@torch.library.custom_op("mega::copy_engine_exchange", mutates_args=())
def copy_engine_exchange(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The equal-blocks all-to-all of ``x`` over the group named ``group_name`` (module
    docstring): rows ``[q * R, (q + 1) * R)`` to rank ``q``, ``R`` the rows over the group's size."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _trip(x, _resolve_process_group(group_name))


@copy_engine_exchange.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty(x.shape)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return copy_engine_exchange(grad.contiguous(), ctx.group_name), None


copy_engine_exchange.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("mega::peer_rows_exchange", mutates_args=())
def peer_rows_exchange(
    x: torch.Tensor, send_rows: torch.Tensor, recv_rows: torch.Tensor, group_name: str
) -> torch.Tensor:
    """:func:`copy_engine_exchange` where block ``q`` of ``x`` holds ``send_rows[q]`` real rows
    first, and only those cross (``MEGA_FLEX_TRANSPORT=peer-rows``, module docstring);
    ``recv_rows[q]``: the real rows of the block that arrives from ``q`` (its gradient's trip
    sends those back)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    real = (send_rows.to(torch.int64).contiguous(), recv_rows.to(torch.int64).contiguous())
    return _trip(x, _resolve_process_group(group_name), real)


@peer_rows_exchange.register_fake
def _(x: torch.Tensor, send_rows: torch.Tensor, recv_rows: torch.Tensor, group_name: str):
    return x.new_empty(x.shape)


def _setup_rows(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.group_name = inputs[3]


def _backward_rows(ctx: Any, grad: torch.Tensor) -> tuple:
    send_rows, recv_rows = ctx.saved_tensors
    back = peer_rows_exchange(grad.contiguous(), recv_rows, send_rows, ctx.group_name)
    return back, None, None, None


peer_rows_exchange.register_autograd(_backward_rows, setup_context=_setup_rows)


def copy_engine_usable(group: Any, like: torch.Tensor) -> bool:
    """Whether the copy engine carries trips of tensors like ``like`` in ``group``: asked for, on
    CUDA GPUs of one host (NCCL's group). Elsewhere the padded trips go by the group's all-to-all
    (CPU ranks run ``copy-engine`` as ``padded``)."""
    return flex_transport() == COPY_ENGINE and peer_copies_possible(group, like)


def peer_rows_usable(group: Any, like: torch.Tensor) -> bool:
    """Whether ``peer-rows`` carries trips of tensors like ``like`` in ``group`` (as
    :func:`copy_engine_usable`; CPU ranks run it as ``padded``)."""
    return flex_transport() == PEER_ROWS and peer_copies_possible(group, like)
