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
keeps NCCL (docs/moe.md).

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
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.distributed import SIGNAL_TIMEOUT_MS as _TIMEOUT_MS
from mega.parallel.distributed import peer_copies_possible
from mega.parallel.expert.validate import flex_transport

COPY_ENGINE = "copy-engine"  # MEGA_FLEX_TRANSPORT's value
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


def _trip(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Block ``q`` of ``x`` (its rows cut in ``group``'s size equal blocks) to rank ``q``; the
    blocks every rank sent here, in rank order."""
    flat = x.contiguous().view(-1).view(torch.uint8)
    inbox = _inbox(group, flat.numel(), x.device)
    handle, me = inbox.handle, inbox.handle.rank
    size = flat.numel() // handle.world_size

    def block(q: int) -> slice:
        return slice(q * size, (q + 1) * size)

    for q in inbox.peers:
        handle.wait_signal(q, _FREE, _TIMEOUT_MS)
        handle.get_buffer(q, (size,), torch.uint8, me * size).copy_(flat[block(q)])
        handle.put_signal(q, _READY, _TIMEOUT_MS)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as the fake says
    raw = out.view(-1).view(torch.uint8)
    raw[block(me)].copy_(flat[block(me)])
    for q in inbox.peers:
        handle.wait_signal(q, _READY, _TIMEOUT_MS)
        raw[block(q)].copy_(inbox.buffer[block(q)])
    for q in inbox.peers:  # read: the peers may write the next trip's blocks
        handle.put_signal(q, _FREE, _TIMEOUT_MS)
    return out


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


def copy_engine_usable(group: Any, like: torch.Tensor) -> bool:
    """Whether the copy engine carries trips of tensors like ``like`` in ``group``: asked for, on
    CUDA GPUs of one host (NCCL's group). Elsewhere the padded trips go by the group's all-to-all
    (CPU ranks run ``copy-engine`` as ``padded``)."""
    return flex_transport() == COPY_ENGINE and peer_copies_possible(group, like)
