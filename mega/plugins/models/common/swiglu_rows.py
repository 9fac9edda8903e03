"""The experts' SwiGLU over the rows their grouped GEMM fills, that number read on the device.

``swiglu_rows(hidden [N, 2F], end [1])``: ``silu(gate) * up`` for rows ``[0, end)`` of the fc1
output (``gate, up = hidden.chunk(2, -1)``); the rows past ``end`` are left unwritten, and so
are their gradients. ``end`` is the grouped GEMM's last offset, a tensor on the GPU, so the host
never reads it (no sync; a CUDA graph replays it for any routing).

Why: the ``flex`` dispatcher's padded arrival has room for any routing (``n`` times the routed
rows and each expert's alignment: at EP2 twice the rows the experts get), and the grouped GEMMs
touch only the rows below their last offset, but the activation Inductor generates runs over
every row. On 2 H200 (a graphed EP2 step of issue 46's MoE, 2026-11-30) its forward took 3.0 ms
and its backward 9.2 ms a step, against 1.5 and 5.0 ms for DP2's same real rows. Here each
program reads ``end`` and returns at once past it. Nothing reads the rows past ``end``: the
fc2 GEMM and both weight gradients stop at the last offset, and the combine's maps take only
real rows.

On CUDA two Triton kernels (forward; backward), in float32 with one rounding to the output's
dtype, as Inductor's fused kernel does; on the CPU (tests, and the CPU ranks that run the
grouped GEMM in tests) the same arithmetic over every row.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK_R, BLOCK_C, NUM_WARPS = 8, 256, 4  # 2,048 elements a program: a memory-bound pass


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def block(h, first, end, f, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # noqa: N803
        # this program's rows and columns, which of them are real, and their gate and up in fp32
        r = first + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < end) & (c[None, :] < f)
        at = r[:, None] * (2 * f) + c[None, :]
        gate = tl.load(h + at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h + at + f, mask=mask, other=0.0).to(tl.float32)
        return r, c, mask, at, gate, up

    @triton.jit
    def forward(h, out, end_at, f, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # noqa: N803
        end = tl.load(end_at).to(tl.int64)
        first = tl.program_id(0).to(tl.int64) * BLOCK_R
        if first < end:
            r, c, mask, at, gate, up = block(h, first, end, f, BLOCK_R, BLOCK_C)
            y = gate * tl.sigmoid(gate) * up
            tl.store(out + r[:, None] * f + c[None, :], y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def backward(g, h, dh, end_at, f, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # noqa: N803
        end = tl.load(end_at).to(tl.int64)
        first = tl.program_id(0).to(tl.int64) * BLOCK_R
        if first < end:
            r, c, mask, at, gate, up = block(h, first, end, f, BLOCK_R, BLOCK_C)
            grad = tl.load(g + r[:, None] * f + c[None, :], mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(gate)
            d_gate = grad * up * s * (1.0 + gate * (1.0 - s))
            d_up = grad * gate * s
            tl.store(dh + at, d_gate.to(dh.dtype.element_ty), mask=mask)
            tl.store(dh + at + f, d_up.to(dh.dtype.element_ty), mask=mask)

    return forward, backward


def _grid(rows: int, f: int) -> tuple[int, int]:
    return (-(-rows // BLOCK_R), -(-f // BLOCK_C))


@torch.library.custom_op("mega::swiglu_rows", mutates_args=())
def swiglu_rows(hidden: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``hidden``'s rows ``[0, end[0])`` (module docstring)."""
    hidden = hidden.contiguous()
    f = hidden.shape[1] // 2
    out = hidden.new_empty(hidden.shape[0], f)
    if not hidden.is_cuda:
        gate, up = hidden.float().chunk(2, dim=-1)
        return out.copy_(torch.nn.functional.silu(gate) * up)
    if hidden.shape[0]:
        forward, _ = _kernels()
        forward[_grid(hidden.shape[0], f)](
            hidden, out, end, f, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS
        )
    return out


@swiglu_rows.register_fake
def _(hidden: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty(hidden.shape[0], hidden.shape[1] // 2)


@torch.library.custom_op("mega::swiglu_rows_backward", mutates_args=())
def swiglu_rows_backward(
    grad: torch.Tensor, hidden: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """The gradient of :func:`swiglu_rows` with respect to ``hidden``, rows ``[0, end[0])``."""
    grad, hidden = grad.contiguous(), hidden.contiguous()
    f = grad.shape[1]
    d_hidden = torch.empty_like(hidden)
    if not hidden.is_cuda:
        gate, up = hidden.float().chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        g = grad.float()
        d_hidden[:, :f] = g * up * s * (1 + gate * (1 - s))
        d_hidden[:, f:] = g * gate * s
        return d_hidden
    if hidden.shape[0]:
        _, backward = _kernels()
        backward[_grid(hidden.shape[0], f)](
            grad, hidden, d_hidden, end, f, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS
        )
    return d_hidden


@swiglu_rows_backward.register_fake
def _(grad: torch.Tensor, hidden: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    hidden, end = ctx.saved_tensors
    return swiglu_rows_backward(grad, hidden, end), None


swiglu_rows.register_autograd(_backward, setup_context=_setup)
