"""A weight's cast under delayed scaling, where its scale is known before the cast: one pass that
writes the FP8 weight both ways and takes its amax (``mega.parallel.fp8.weight_kernels``, Triton,
on a GPU). Against the compiled graph's three passes (the cast; the cast again, transposed, in
the backward, which the compiler recomputes rather than keep; the amax in the update), it reads
the weight once instead of three times, and keeps the transposed copy for the backward (one byte
per weight). Elsewhere (the CPU, no Triton) the eager ops it fuses run, which are the
reference.
"""

from __future__ import annotations

import torch

from mega.parallel.fp8 import gelu_cast
from mega.parallel.fp8.scaling import E4M3, cast_with_scale

KERNELS = None  # the Triton kernel's module, once load_kernels() has found it


def load_kernels() -> bool:
    """Import both FP8 kernel modules, the GeLU's (:func:`gelu_cast.load_kernels`) and the
    weight's, where Triton is there; True when they are."""
    global KERNELS
    if KERNELS is None and gelu_cast.load_kernels():
        from mega.parallel.fp8 import weight_kernels

        KERNELS = weight_kernels
    return KERNELS is not None


def weight_to_fp8_reference(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` in E4M3 with ``scale``: (data, data transposed, amax as a 1-element tensor)."""
    data = cast_with_scale(weight, scale, E4M3)
    return data, data.t().contiguous(), weight.detach().abs().amax().float().reshape(1)


def weight_to_fp8(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``[out, in]`` weight in E4M3 with a given ``scale``: (data, data transposed ``[in,
    out]``, partial amaxes whose max is the weight's amax)."""
    if weight.is_cuda and KERNELS is not None:
        # the kernel indexes a row-major weight (a parameter is; a model's transposed view is not)
        return torch.ops.mega.weight_to_fp8(weight.contiguous(), scale)
    return weight_to_fp8_reference(weight, scale)
