"""The GeLU between FC1 and FC2 when both are FP8: from FC1's output straight to FC2's FP8 input,
and back from FC2's input gradient straight to FC1's FP8 output gradient.

Left to the compiler, each cast needs its tensor's amax first, and inductor recomputes the cast's
producer in separate kernels for the amax, the cast, the bias gradient and the transposed copy,
each re-reading the producer's inputs: on one H100 FC1's output-gradient site took 0.50 ms per
layer of the 1.3B GPT, against bf16's 0.20 ms. Here each site is two passes over what it reads
(``mega.parallel.fp8.gelu_kernels``, Triton), as opaque ops the compiler leaves alone. Elsewhere
(the CPU, no Triton) the same functions run as the eager ops they fuse, which are the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mega.parallel.fp8.scaling import E4M3, cast_with_scale, scale_for


def gelu_to_fp8_reference(
    y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gelu(y + bias)`` in FP8, with ``scale`` or (None) from its amax: (data, scale, inverse
    scale, amax)."""
    h = F.gelu(y if bias is None else y + bias)
    amax = h.detach().abs().amax().float()
    scale = scale_for(amax, dtype) if scale is None else scale.clone()
    return cast_with_scale(h, scale, dtype), scale, scale.reciprocal(), amax


def gelu_grad_to_fp8_reference(
    grad: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    h_scale: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g = grad * gelu'(y + bias)`` in FP8 row-major and transposed (with ``scale`` or from its
    amax), its inverse scale, its column sums (the bias gradient), FC2's input again
    (``gelu(y + bias)`` cast to E4M3 with ``h_scale``), transposed, and its amax."""
    x = y if bias is None else y + bias
    g = torch.ops.aten.gelu_backward(grad, x)
    amax = g.abs().amax(dim=0).amax().float()
    scale = scale_for(amax, dtype) if scale is None else scale
    data = cast_with_scale(g, scale, dtype)
    h_t = cast_with_scale(F.gelu(x), h_scale, E4M3).t().contiguous()
    return data, data.t().contiguous(), scale.reciprocal(), g.sum(0), h_t, amax


KERNELS = None  # the Triton kernels' module, once load_kernels() has found it


def load_kernels() -> bool:
    """Import the Triton kernels (which registers their ops) on a CUDA build of torch with Triton
    installed; True when they are there (elsewhere the reference runs). Called when a model is
    marked for FP8 (``mega.parallel.fp8.apply``), not at import: ``torch.library.triton_op``
    imports ``torch._inductor`` and ``torch._dynamo``, seconds that every other command paid on
    the GPU machines (torch 2.11 with Triton; ``tests/test_fast_paths.py``)."""
    global KERNELS
    if KERNELS is None and torch.version.cuda is not None:
        try:
            from mega.parallel.fp8 import gelu_kernels
        except ImportError:
            return False
        KERNELS = gelu_kernels
    return KERNELS is not None


def _use_kernels(y: torch.Tensor) -> bool:
    return y.is_cuda and KERNELS is not None


def gelu_to_fp8(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gelu(y + bias)`` of FC1's ``[tokens, ffn]`` output as FC2's FP8 input, with ``scale``
    (delayed scaling) or from its amax: (data, scale, inverse scale, amax)."""
    if _use_kernels(y):
        return torch.ops.mega.gelu_to_fp8(y, bias, dtype, scale)
    return gelu_to_fp8_reference(y, bias, dtype, scale)


def gelu_grad_to_fp8(
    grad: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    h_scale: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FC1's output gradient from FC2's input gradient ``grad``, with ``scale`` or from its amax:
    (FP8 row-major, FP8 transposed, inverse scale, bias gradient, FC2's FP8 input transposed,
    amax)."""
    if _use_kernels(y):
        return torch.ops.mega.gelu_grad_to_fp8(grad, y, bias, h_scale, dtype, scale)
    return gelu_grad_to_fp8_reference(grad, y, bias, h_scale, dtype, scale)
