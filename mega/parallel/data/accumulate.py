"""A micro-batch's low-precision gradient into its fp32 ``main_grad``: copied (the step's first)
or added (the rest), as :mod:`mega.parallel.data.grad_buffer`'s hook does for every parameter
whose weight-gradient GEMM does not write ``main_grad`` itself (the MoE experts' grouped GEMMs,
embeddings, norms, and every weight under ``--no-gradient-accumulation-fusion``).

Why a kernel of its own: PyTorch's ``copy_``/``add_`` of a bf16 tensor into an fp32 one take
TensorIterator's dynamic-cast path (``unrolled_elementwise_kernel``), not its vectorised one. On
one H200 (2026-12-01, 92M elements) ``add_`` ran at 2.8 TB/s and ``copy_`` at 2.1, where a Triton
kernel that loads, converts and stores in one pass ran at 4.2 and 3.9: on 2 H200, DP2 of issue
46's MoE spent 7.8 ms a step in those adds and ~5 in the copies (1.7e9 expert elements a
micro-batch). Below :data:`TRITON_MIN_ELEMENTS` torch's ops stay: a Triton launch costs the host
~20 us, more than the kernel saves there. On the CPU, and for tensors the kernel does not take
(other dtypes, not contiguous), torch's ops run; the result is the same either way: each element
``float32(main) + float32(grad)`` rounded once, or ``float32(grad)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

TRITON_MIN_ELEMENTS = 1 << 23  # ~8M: where the kernel's 1.4x outweighs its launch (module doc)
_BLOCK, _NUM_WARPS = 4096, 8
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def accumulate(main, grad, n, BLOCK: tl.constexpr, COPY: tl.constexpr):  # noqa: N803
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        value = tl.load(grad + at, mask=mask).to(tl.float32)
        if not COPY:
            value += tl.load(main + at, mask=mask)
        tl.store(main + at, value, mask=mask)

    return accumulate


def takes_triton(main_grad: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether :func:`accumulate_into` runs the Triton kernel for this pair."""
    return (
        main_grad.is_cuda
        and main_grad.dtype == torch.float32
        and grad.dtype in _LOW_PRECISION
        and main_grad.numel() >= TRITON_MIN_ELEMENTS
        and main_grad.numel() == grad.numel()
        and main_grad.is_contiguous()
        and grad.is_contiguous()
        and grad.device == main_grad.device
    )


def accumulate_into(main_grad: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """``main_grad = grad`` (``first``) or ``main_grad += grad``, in fp32 (module docstring)."""
    if not takes_triton(main_grad, grad):
        if first:
            main_grad.copy_(grad)  # fp32 <- model dtype
        else:
            main_grad.add_(grad)  # fp32 += model dtype: accumulation in fp32
        return
    n = main_grad.numel()
    grid = ((n + _BLOCK - 1) // _BLOCK,)
    with torch.cuda.device(main_grad.device):
        _kernel()[grid](main_grad, grad, n, BLOCK=_BLOCK, COPY=first, num_warps=_NUM_WARPS)
