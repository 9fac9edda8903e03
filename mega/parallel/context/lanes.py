"""How the ring's blocks travel from one rank to the next: a *lane* is one direction of the ring.

``send(tensors)`` passes this rank's tensors to the rank ahead and returns an :class:`Arrival`
of the same shapes from the rank behind; ``finish()`` ends a pass (one attention's forward or
backward). Two kinds, chosen by ``MEGA_CP_P2P_TRANSPORT``:

- ``nccl`` (the default), :class:`MessageLane`: send/recv of the process group (NCCL or gloo),
  fresh tensors per step.
- ``copy-engine``, :class:`CopyEngineLane`, on CUDA GPUs of one host: the block is copied by the
  copy engine straight into the next rank's inbox in symmetric memory (peer-mapped), no SM taken.
  Elsewhere the variable falls back to ``nccl``.

Why both, measured on 4 H200 (1.3B GPT, 16k tokens, CP4, ``docs/context-parallelism.md``): a
32 MiB block took 0.29 ms by NCCL send/recv alone and 0.17 ms copied; inside a training step
NCCL's send/recv kernels ran 0.45-1.2 ms and the copies 0.088 ms. Yet the step was no faster
(16,880 tokens/s per GPU copied, 18,273 by NCCL, one run each, and CP4 runs vary by 10% between
sessions): a CP4 rank alone takes 1,038 ms a step and the ring 1,800-1,900, so what the ring
costs is its ranks waiting for one another, which a faster wire does not change, and a copy lane
launches more from the host (four signal kernels and an event a step). NCCL stays the default
until a measurement says otherwise.

The copy lane's protocol, for a rank and its inbox of two slots, in stream order on the lane's
own stream: send ``k`` goes to slot ``k % 2`` of the next rank's inbox after that rank's *free*
token for the slot (which says it has computed on and passed on what the slot held), then puts a
*ready* token; the arrival is this rank's own slot once the previous rank's ready token is
taken. A slot received at send ``k`` is computed on and passed on at step ``k + 1``, so it is
freed when send ``k + 2`` is posted, or at ``finish``. Tokens are symmetric memory's signals (a
put waits for the slot's flag to be clear, a wait clears it), so a pass ends with every token
back where it began. Every wait has a timeout (a peer that died traps instead of hanging).

What the caller must do: pass what outlives the pass through ``own`` (a copy out of the inbox,
for a copy lane) before ``finish``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mega.parallel import comm
from mega.parallel.context.transport_choice import chosen_transport
from mega.parallel.distributed import SIGNAL_TIMEOUT_MS as _TIMEOUT_MS
from mega.parallel.distributed import peer_copies_possible

_ALIGN = 512  # bytes: every tensor in a slot starts aligned for any dtype's view
_READY, _FREE = (0, 1), (2, 3)  # signal channels per slot


class Arrival:
    """What a ``send`` brings from the previous rank; ``wait`` makes the current stream wait for
    it and returns the tensors."""

    def __init__(self, wait: Any, tensors: list[torch.Tensor]) -> None:
        self._wait, self._tensors = wait, tensors

    def wait(self) -> list[torch.Tensor]:
        self._wait()
        return self._tensors


class MessageLane:
    """Send/recv of the process group: ``to`` and ``frm`` are global ranks."""

    def __init__(self, group: Any, to: int, frm: int) -> None:
        self.group, self.to, self.frm = group, to, frm

    def send(self, tensors: list[torch.Tensor]) -> Arrival:
        incoming = [torch.empty_like(t) for t in tensors]
        sends = [(t, self.to) for t in tensors]
        posted = comm.exchange(sends, [(x, self.frm) for x in incoming], self.group, wait=False)
        return Arrival(posted.wait, incoming)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def finish(self) -> None:
        pass


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class CopyEngineLane:
    """The copy engine into the next rank's symmetric-memory inbox (see the module docstring).
    ``to`` and ``frm``: ranks within ``group``. The inbox grows (a collective of the group: every
    member sends the same shapes) when a pass needs more than it holds."""

    def __init__(self, group: Any, to: int, frm: int) -> None:
        self.group, self.to, self.frm = group, to, frm
        self.stream = torch.cuda.Stream()
        self.slot_bytes, self.buffer, self.handle, self.views = 0, None, None, {}
        self.sent, self.held, self.keep = 0, [], []

    def _grow(self, nbytes: int, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if self.handle is not None:
            self.stream.synchronize()  # nothing of the old inbox still in flight
        self.buffer = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.slot_bytes, self.views = nbytes, {}
        with torch.cuda.stream(self.stream):  # both slots start free
            for slot in (0, 1):
                self.handle.put_signal(self.frm, _FREE[slot], _TIMEOUT_MS)

    def _views(self, rank: int, slot: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors``' shapes laid out one after another in ``rank``'s inbox slot (made once per
        layout: the host, not the copy, is what a ring step waits for at small blocks)."""
        key = (rank, slot, *((t.shape, t.dtype) for t in tensors))
        if key not in self.views:
            self.views[key] = self._lay_out(rank, slot, tensors)
        return self.views[key]

    def _lay_out(self, rank: int, slot: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        views, offset = [], slot * self.slot_bytes
        for t in tensors:
            size = t.numel() * t.element_size()
            if rank == self.handle.rank:
                raw = self.buffer[offset : offset + size]
            else:
                raw = self.handle.get_buffer(rank, (size,), torch.uint8, offset)
            views.append(raw.view(t.dtype).view(t.shape))
            offset += _aligned(size)
        return views

    def send(self, tensors: list[torch.Tensor]) -> Arrival:
        tensors = [t.contiguous() for t in tensors]
        nbytes = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
        if nbytes > self.slot_bytes:
            self._grow(nbytes, tensors[0].device)
        slot = self.sent % 2
        self.stream.wait_stream(torch.cuda.current_stream())  # the payload is ready
        with torch.cuda.stream(self.stream):
            if len(self.held) == 2:  # computed on and passed on by now (see the docstring)
                self.handle.put_signal(self.frm, _FREE[self.held.pop(0)], _TIMEOUT_MS)
            self.handle.wait_signal(self.to, _FREE[slot], _TIMEOUT_MS)
            for remote, t in zip(self._views(self.to, slot, tensors), tensors, strict=True):
                remote.copy_(t)
            self.handle.put_signal(self.to, _READY[slot], _TIMEOUT_MS)
            self.handle.wait_signal(self.frm, _READY[slot], _TIMEOUT_MS)
            arrived = torch.cuda.Event()
            arrived.record()
        self.held.append(slot)
        self.sent += 1
        self.keep += tensors  # read on the lane's stream: freed after finish's wait
        incoming = self._views(self.handle.rank, slot, tensors)
        return Arrival(lambda: torch.cuda.current_stream().wait_event(arrived), incoming)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, copied if it lies in the inbox (which the next pass overwrites)."""
        inbox = self.buffer is not None and (
            tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        )
        return tensor.clone() if inbox else tensor

    def finish(self) -> None:
        if not self.held:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for slot in self.held:
                self.handle.put_signal(self.frm, _FREE[slot], _TIMEOUT_MS)
        torch.cuda.current_stream().wait_stream(self.stream)
        self.sent, self.held, self.keep = 0, [], []


_COPY_LANES: dict[tuple, CopyEngineLane] = {}


def copy_engine_usable(group: Any, like: torch.Tensor) -> bool:
    """Whether the ring of ``group`` can use the copy engine for tensors like ``like``."""
    return chosen_transport() == "copy-engine" and peer_copies_possible(group, like)


def lane(group: Any, to: int, frm: int, name: str, like: torch.Tensor) -> Any:
    """The lane ``name`` of ``group`` sending to global rank ``to``, receiving from ``frm``. Copy
    lanes are kept (their inboxes are reused by every layer); a name is one pass's lane."""
    if not copy_engine_usable(group, like):
        return MessageLane(group, to, frm)
    key = (group.group_name, name, to, frm)
    if key not in _COPY_LANES:
        local = dist.get_group_rank
        _COPY_LANES[key] = CopyEngineLane(group, local(group, to), local(group, frm))
    return _COPY_LANES[key]
