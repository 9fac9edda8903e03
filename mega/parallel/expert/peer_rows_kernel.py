"""A copy of a block's first rows, their number read on the device: the peer-rows trips' writes.

``copy_first_rows(dst, src, rows)`` copies rows ``[0, rows[0])`` of ``src`` into ``dst`` (both
``[R, ...]``, contiguous, same shape and dtype; ``dst`` may be a peer's memory, mapped into this
process by torch's symmetric memory). ``rows`` is a one-element int64 tensor on the GPU, so the
host never reads it (no sync): the kernel's programs past the last row return at once, and only
the real rows' bytes cross NVLink. A Triton kernel, compiled on first use; GPUs only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# elements per program: 16 KiB of bytes (the trips copy uint8 views), in flight per SM for
# NVLink's stores
BLOCK = 16384


@functools.cache
def _kernel() -> Callable:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_first(dst, src, rows, row_elements, BLOCK: tl.constexpr):  # noqa: N803
        start = tl.program_id(0).to(tl.int64) * BLOCK
        end = tl.load(rows).to(tl.int64) * row_elements
        if start < end:
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < end
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    return copy_first


def copy_first_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows ``[0, rows[0])`` of ``src`` into ``dst`` on the current stream (module docstring)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"copy_first_rows: dst {dst.shape} {dst.dtype}, src {src.shape} {src.dtype}"
        )
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_first_rows: dst and src must be contiguous")
    if src.numel() == 0:
        return
    row_elements = src[0].numel()
    grid = (-(-src.numel() // BLOCK),)
    _kernel()[grid](dst, src, rows, row_elements, BLOCK=BLOCK)
