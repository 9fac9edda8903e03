"""The padded trips' equal blocks by the copy engine: ``MEGA_FLEX_TRANSPORT=copy-engine``.

The padded transport (:mod:`mega.parallel.expert.padded_exchange`) sends every rank of the
expert-parallel group a block of the same size; this carries those blocks instead of NCCL's
all-to-all where the group's GPUs share a host: each rank copies its block for rank ``q`` into
``q``'s inbox in symmetric memory (peer-mapped: the copy engine moves it, no SM taken from the
GEMMs), and reads what arrived in its own.

Why: on 2 H200 an in-order flex EP2 step spent 71 ms of ~230 in its padded trips (2026-11-30,
c1c71fd): each carried twice the real rows at NCCL's point-to-point rate (~100 GB/s a
direction), where the copy engine moved 32-64 MiB rank to rank in a ring of 4 H200 at 203-257
GB/s (``collectives_ring_4gpu_h200_2026-11-28.json``, the CP ring's copy lane).

Each trip, on the current stream (in order with the layer's kernels; nothing read on the host):
for every peer ``q``, wait for ``q``'s *free* token (its inbox's block from this rank has been
read), copy the block into it, put a *ready* token; then wait for every peer's *ready* token,
copy the arrived blocks out (and this rank's own block from its input) into a fresh tensor, and
put a *free* token to every peer. Tokens are symmetric memory's signals (a put waits for the
flag to be clear, a wait clears it), so a trip ends with every token where it began. The inbox
(one per group) is made by a rendezvous of the group on its first trip, which every
rank makes with the same sizes (every rank routes the same number of slots); a larger trip makes
a larger one, a smaller trip uses the start of it. The same protocol
and signals as the CP ring's copy lane (:mod:`mega.parallel.context.lanes`), which ran right on 4
H200.

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

from mega.parallel.distributed import SIGNAL_TIMEOUT_MS as _TIMEOUT_MS
from mega.parallel.distributed import peer_copies_possible
from mega.parallel.expert.validate import flex_transport

COPY_ENGINE = "copy-engine"  # MEGA_FLEX_TRANSPORT's values
PEER_ROWS = "peer-rows"
_READY, _FREE = 0, 1  # signal channels


class _Inbox:
    """A rank's symmetric buffer for a group's trips, and its signal handle; made on the stream
    every trip of the group must run on (the tokens order the trips: one stream, one order)."""

    def __init__(self, group: Any, nbytes: int, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if torch.cuda.is_current_stream_capturing():  # a rendezvous is a host collective
            raise RuntimeError("the copy-engine trips' inbox cannot be made in a CUDA graph")
        self.stream = torch.cuda.current_stream(device)
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        me, size = self.handle.rank, self.handle.world_size
        # from the next rank on: the ranks do not all copy into the same peer first
        self.peers = [(me + k) % size for k in range(1, size)]
        for q in self.peers:  # every peer may write its block here for the first trip
            self.handle.put_signal(q, _FREE, _TIMEOUT_MS)


# one inbox per group, as large as its largest trip (a smaller trip uses its start); the inboxes
# a larger trip replaced stay alive: the GPU may still read them, and they are few
_INBOXES: dict[str, _Inbox] = {}
_RETIRED: list[_Inbox] = []


def _inbox(group: Any, nbytes: int, device: torch.device) -> _Inbox:
    inbox = _INBOXES.get(group.group_name)
    if inbox is None or inbox.buffer.numel() < nbytes:
        if inbox is not None:  # every rank grows at the same trip: the same sizes, in order
            _RETIRED.append(inbox)
        inbox = _INBOXES[group.group_name] = _Inbox(group, nbytes, device)
    if torch.cuda.current_stream(device) != inbox.stream:
        raise RuntimeError(
            "the copy-engine trips of a group run in order on one stream (their signals order"
            " them); this one is on another"
        )
    return inbox


def _trip(
    x: torch.Tensor, group: Any, real: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Block ``q`` of ``x`` (its rows cut in ``group``'s size equal blocks) to rank ``q``; the
    blocks every rank sent here, in rank order. With ``real`` (``send_rows, recv_rows``, each
    ``[group size]`` on the device) only the first ``send_rows[q]`` rows of block ``q`` cross,
    by a kernel, and only the first ``recv_rows[q]`` of what arrived from ``q`` are copied out
    (the rest of the result is left unwritten)."""
    flat = x.contiguous().view(-1).view(torch.uint8)
    inbox = _inbox(group, flat.numel(), x.device)
    handle, me = inbox.handle, inbox.handle.rank
    size = flat.numel() // handle.world_size
    rows = x.shape[0] // handle.world_size

    def block(q: int) -> slice:
        return slice(q * size, (q + 1) * size)

    for q in inbox.peers:
        handle.wait_signal(q, _FREE, _TIMEOUT_MS)
        _copy(
            handle.get_buffer(q, (size,), torch.uint8, me * size), flat[block(q)], real, rows, 0, q
        )
        handle.put_signal(q, _READY, _TIMEOUT_MS)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as the fake says
    raw = out.view(-1).view(torch.uint8)
    _copy(raw[block(me)], flat[block(me)], real, rows, 0, me)
    for q in inbox.peers:
        handle.wait_signal(q, _READY, _TIMEOUT_MS)
        _copy(raw[block(q)], inbox.buffer[block(q)], real, rows, 1, q)
    for q in inbox.peers:  # read: the peers may write the next trip's blocks
        handle.put_signal(q, _FREE, _TIMEOUT_MS)
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, real: tuple | None, rows: int, which: int, q: int):
    """One block's bytes ``src`` (``rows`` rows) into ``dst``: whole (the copy engine), or with
    ``real`` its first ``real[which][q]`` rows by a kernel that reads that count on the device."""
    if real is None:
        dst.copy_(src)
    elif rows:
        from mega.parallel.expert.peer_rows_kernel import copy_first_rows

        copy_first_rows(dst.view(rows, -1), src.view(rows, -1), real[which][q:])


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
