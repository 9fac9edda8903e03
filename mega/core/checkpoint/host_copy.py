"""Host copies of a checkpoint's pieces, taken without stopping training (``--async-save``).

One buffer holds every piece this rank writes; it is allocated at the first use and reused by
every later save (they have the same pieces). On CUDA the buffer is pinned once
(``cudaHostRegister``: pinning through torch's caching host allocator would round 18 GB up to
32 GB), and the device-to-host copies are queued on a side stream: the step that starts the
save does not wait for them. Only the next optimizer update must, because it changes the
values being copied: :meth:`HostCopy.before_update` makes the compute stream wait for the
copies on the GPU, so the CPU never blocks and the copies overlap the next forward and backward.
On CPU the copy is a plain memcpy, made at once.

The buffer is not reused before the save that reads it is complete: a save starts only after
the previous one finished (``finish_pending_save``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from mega.parallel.sharded import Piece, ShardedTensor

ALIGN = 64  # bytes: every piece starts on a cache line


def _nbytes(piece: Piece) -> int:
    return piece.data.numel() * piece.data.element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bytes_needed(tensors: list[ShardedTensor]) -> int:
    """The buffer size that holds the pieces of ``tensors`` (``owned`` ones are not copied)."""
    return sum(_aligned(_nbytes(p)) for t in tensors for p in t.pieces if not p.owned)


class HostCopy:
    """A reusable host buffer and the copies into it (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pinned = False
        self._stream: Any = None
        self._event: Any = None

    @property
    def pinned(self) -> bool:
        return self._pinned

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Allocate (and on CUDA pin) a buffer of at least ``nbytes``; a larger one is kept."""
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return
        self.release()
        self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if device.type == "cuda":
            # Pinned memory makes the copies asynchronous and about twice as fast; without it
            # they still work, synchronously.
            error = torch.cuda.cudart().cudaHostRegister(
                self._buffer.data_ptr(), self._buffer.numel(), 0
            )
            self._pinned = int(error) == 0

    def release(self) -> None:
        """Unpin and free the buffer (the next :meth:`take` allocates one again)."""
        if self._buffer is not None and self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._buffer, self._pinned = None, False

    def take(self, tensors: list[ShardedTensor]) -> list[ShardedTensor]:
        """The same tensors with pieces copied into the buffer. On CUDA the copies are still in
        flight: :meth:`wait` before reading them, :meth:`before_update` before changing the
        originals. ``owned`` pieces (copies made for this save) are written from as they are."""
        device = next(
            (p.data.device for t in tensors for p in t.pieces if not p.owned), torch.device("cpu")
        )
        self.reserve(bytes_needed(tensors), device)
        assert self._buffer is not None
        cuda = device.type == "cuda"
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # the values are final
        copies, offset = [], 0
        with torch.cuda.stream(self._stream) if cuda else nullcontext():
            for t in tensors:
                pieces = []
                for piece in t.pieces:
                    if piece.owned:
                        pieces.append(piece)
                        continue
                    n = _nbytes(piece)
                    view = self._buffer[offset : offset + n].view(piece.data.dtype)
                    view = view.view(piece.data.shape)
                    view.copy_(piece.data, non_blocking=self._pinned)
                    if cuda:  # a temporary source must outlive the copy on the side stream
                        piece.data.record_stream(self._stream)
                    pieces.append(Piece(piece.start, view))
                    offset += _aligned(n)
                copies.append(
                    ShardedTensor(
                        t.key, t.global_shape, t.dtype, pieces, t.write, t.chunks, t.fallback
                    )
                )
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        return copies

    def before_update(self) -> None:
        """Make the current stream wait (on the GPU) until the copies have read the values."""
        if self._event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._event)

    def wait(self) -> None:
        """Block until the copies are in the buffer."""
        if self._event is not None:
            self._event.synchronize()
