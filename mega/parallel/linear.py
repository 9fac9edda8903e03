"""The linear layer every mega model and parallel plugin calls: ``F.linear``, with Megatron's
gradient accumulation fusion (``mega.parallel.weight_grad``) and, for weights the FP8 plan marked,
FP8 GEMMs (``mega.parallel.fp8``).

Without fusion, backward writes each weight's gradient in the model's dtype and a hook then adds
it into the fp32 ``main_grad`` of the :class:`~mega.parallel.data.grad_buffer.ParamAndGradBuffer`: for a
bf16 1.3B model that is 2.6 GB written, read again, and 10 GB of fp32 read-modify-write per
micro-batch. Fused, the weight-gradient GEMM accumulates straight into ``main_grad`` in fp32.

The GEMM runs inside the custom op ``mega::weight_grad``, which ``torch.compile`` treats as one
opaque call: a compiled layer stays one graph, forward and backward, with its bias gradients fused
into the neighbouring kernels. (Behind ``torch.compiler.disable`` each linear broke the layer's
graph; on an H100 that cost 8% of a 1.3B GPT's step in host time.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.parallel.fp8.delayed import Sites, sites_of
from mega.parallel.fp8.linear import fp8_linear
from mega.parallel.weight_grad import (
    OpaqueWhenTraced,
    WeightGradQueue,
    accumulate_wgrad,
    deferring_weight_grads,
    fused_weight_grad,
    register_fused_weight,
)

# still importable from here, where they lived before mega.parallel.weight_grad (plugins use them)
__all__ = [
    "Linear",
    "WeightGradQueue",
    "accumulate_wgrad",
    "deferring_weight_grads",
    "linear",
    "register_fused_weight",
]


def _weight_grad_body(
    grad_2d: torch.Tensor, inputs_2d: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The fused weight gradient, as one op that torch.compile leaves opaque: it runs the GEMM
    into ``main_grad`` (or queues it) and returns the placeholder gradient that autograd hands the
    weight. Declared pure on purpose: what it writes (``main_grad``, the flags) is read by nothing
    inside a compiled graph, and its result is used, so the compiler neither drops nor reorders
    it across its inputs. As an op rather than a disabled function it costs the layer's compiled
    graph no break, forward or backward: a break measured about 250 us of host time per linear."""
    return fused_weight_grad(weight, accumulate_wgrad, (grad_2d, inputs_2d))


_weight_grad = OpaqueWhenTraced("mega::weight_grad", _weight_grad_body)


@_weight_grad.op.register_fake
def _(grad_2d: torch.Tensor, inputs_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(weight)


def fuses_wgrad(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient GEMM goes into its ``main_grad`` when recorded now."""
    return getattr(weight, "fuse_wgrad", False) and torch.is_grad_enabled() and weight.requires_grad


class _LinearAccumulatingWgrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, out]
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        grad_weight = _weight_grad(grad_2d, x.reshape(-1, x.shape[-1]), weight)
        return grad_input, grad_weight, grad_bias


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp8_sites: Sites | None = None,
) -> torch.Tensor:
    """``F.linear``, in FP8 when the weight carries an ``fp8_format`` (``mega.parallel.fp8``;
    ``fp8_sites``: the calling module's delayed scaling, ``sites_of(module)``), with the weight
    gradient fused into ``weight.main_grad`` when the weight has opted in (``fuse_wgrad``) and
    gradients are being recorded."""
    fp8_format = getattr(weight, "fp8_format", None)
    if fp8_format is not None:
        fuse = getattr(weight, "fuse_wgrad", False)
        return fp8_linear(x, weight, bias, fp8_format, fuse, fp8_sites)
    if fuses_wgrad(weight):
        return _LinearAccumulatingWgrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward goes through :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, sites_of(self))

    # the two sides of the GEMM, as the tensor-parallel linears split them (a fused MLP calls them)
    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as this layer's GEMM reads it: unchanged."""
        return x

    def reduce_output(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from its GEMM's product: the bias added."""
        return partial if self.bias is None else partial + self.bias
