"""The FP8 linear: ``y = x W^T + b`` with all three GEMMs in FP8 (``torch._scaled_mm``), each
operand scaled per tensor (``mega.parallel.fp8.scaling``).

- forward: ``x`` and ``W`` in E4M3, output in the activations' dtype (bf16), fast accumulation
  (as torchao: the forward GEMM's error is rounded away in bf16);
- input gradient: ``dY`` (E5M2 under ``hybrid``, else E4M3) times ``W``, full-precision
  accumulation;
- weight gradient: ``dY^T x`` from the same FP8 copies, in fp32: written into ``main_grad``
  directly on a step's first micro-batch (``out=``), added after on later ones
  (``_scaled_mm`` has no accumulate), through the op ``mega::weight_grad_fp8`` that
  ``mega.parallel.weight_grad`` may defer; without fusion, in the weight's dtype.

Backward keeps the FP8 copies of ``x`` and ``W`` (half the bytes of bf16 ``x``). ``_scaled_mm``
wants its first operand row-major and its second column-major; the transposed copies that needs
are made here, where the compiler fuses them into the casts.
"""

from __future__ import annotations

import torch

from mega.parallel.fp8.delayed import GRAD, INPUT, Sites, to_fp8_at, weight_to_fp8_at
from mega.parallel.fp8.scaling import E4M3, GRAD_DTYPES
from mega.parallel.weight_grad import fused_weight_grad


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.t().is_contiguous() else t.t().contiguous().t()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def accumulate_wgrad_fp8(
    main_grad: torch.Tensor,
    grad_t: torch.Tensor,
    inputs: torch.Tensor,
    grad_inverse: torch.Tensor,
    inputs_inverse: torch.Tensor,
    *,
    overwrite: bool,
) -> None:
    """``main_grad (+)= grad_t @ inputs`` in fp32 from FP8 operands ``[out, tokens]`` (row-major)
    and ``[tokens, in]`` (column-major) with their inverse scales."""
    a, b = _row_major(grad_t), _column_major(inputs)
    if overwrite:
        torch._scaled_mm(a, b, grad_inverse, inputs_inverse, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(
            torch._scaled_mm(a, b, grad_inverse, inputs_inverse, out_dtype=torch.float32)
        )


@torch.library.custom_op("mega::weight_grad_fp8", mutates_args=())
def _weight_grad_fp8(
    grad_t: torch.Tensor,
    inputs: torch.Tensor,
    grad_inverse: torch.Tensor,
    inputs_inverse: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """``mega::weight_grad`` (``mega.parallel.linear``) for FP8 operands: one opaque op that
    writes ``weight``'s ``main_grad`` (or queues the GEMM) and returns its placeholder gradient."""
    operands = (grad_t, inputs, grad_inverse, inputs_inverse)
    return fused_weight_grad(weight, accumulate_wgrad_fp8, operands)


@_weight_grad_fp8.register_fake
def _(grad_t, inputs, grad_inverse, inputs_inverse, weight):  # noqa: ANN001, ANN202
    return torch.empty_like(weight)


def weight_grad_fp8(
    grad_t: torch.Tensor,
    inputs: torch.Tensor,
    grad_inverse: torch.Tensor,
    inputs_inverse: torch.Tensor,
    weight: torch.Tensor,
    fuse: bool,
) -> torch.Tensor:
    """The weight gradient ``grad_t @ inputs`` from FP8 ``[out, tokens]`` (row-major) and
    ``[tokens, in]``: into ``main_grad`` (returning the placeholder) when ``fuse``, else in the
    weight's dtype."""
    inputs = _column_major(inputs)
    if fuse:
        return _weight_grad_fp8(grad_t, inputs, grad_inverse, inputs_inverse, weight)
    return torch._scaled_mm(grad_t, inputs, grad_inverse, inputs_inverse, out_dtype=weight.dtype)


def input_grad_fp8(
    grad: torch.Tensor,
    weight: torch.Tensor,
    grad_inverse: torch.Tensor,
    weight_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The input gradient ``grad @ weight`` from FP8 ``[tokens, out]`` and ``[out, in]``,
    full-precision accumulation."""
    return torch._scaled_mm(
        grad, _column_major(weight), grad_inverse, weight_inverse, out_dtype=out_dtype
    )


def forward_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_inverse: torch.Tensor,
    weight_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x @ weight^T`` from FP8 ``[tokens, in]`` and ``[out, in]``, fast accumulation."""
    return torch._scaled_mm(
        x, weight.t(), x_inverse, weight_inverse, out_dtype=out_dtype, use_fast_accum=True
    )


def fuses_wgrad(weight: torch.Tensor, fuse_wgrad: bool) -> bool:
    """Whether this call writes ``weight``'s gradient into ``main_grad``: it opted in and
    gradients are being recorded for it."""
    return fuse_wgrad and torch.is_grad_enabled() and weight.requires_grad


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        grad_dtype: torch.dtype,
        fuse_wgrad: bool,
        sites: Sites | None,
        record: bool,
    ) -> torch.Tensor:
        x_2d = x.reshape(-1, x.shape[-1])  # [tokens, in]
        x_fp8, x_inverse = to_fp8_at(x_2d, E4M3, sites, INPUT, record)
        # [out, in]: its .t() is column-major; w_grad_side: what the input gradient reads
        w_fp8, w_grad_side, w_inverse = weight_to_fp8_at(weight, sites, record)
        out = forward_fp8(x_fp8, w_fp8, x_inverse, w_inverse, x.dtype)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x_fp8, x_inverse, w_grad_side, w_inverse, weight)
        ctx.has_bias, ctx.grad_dtype, ctx.fuse_wgrad = bias is not None, grad_dtype, fuse_wgrad
        ctx.sites = sites  # not saved for backward: the casts write its history in place
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_fp8, x_inverse, w_grad_side, w_inverse, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, out]
        # with a bias, its gradient and the amax are one pass over the output gradient
        g_fp8, g_inverse = to_fp8_at(
            grad_2d, ctx.grad_dtype, ctx.sites, GRAD, True, columns_first=ctx.has_bias
        )
        grad_input = grad_weight = grad_bias = None
        if needs_input:
            grad_input = input_grad_fp8(g_fp8, w_grad_side, g_inverse, w_inverse, grad_output.dtype)
            grad_input = grad_input.view(*grad_output.shape[:-1], grad_input.shape[-1])
        if needs_weight:
            grad_weight = weight_grad_fp8(
                g_fp8.t().contiguous(), x_fp8, g_inverse, x_inverse, weight, ctx.fuse_wgrad
            )
        if ctx.has_bias and needs_bias:
            grad_bias = grad_2d.sum(0)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fp8_format: str,
    fuse_wgrad: bool,
    sites: Sites | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in FP8 (``--fp8-format e4m3`` or ``hybrid``); the weight
    gradient goes into ``main_grad`` when ``fuse_wgrad`` and gradients are being recorded.
    ``sites``: the linear's delayed scaling (``mega.parallel.fp8.delayed``), None for current
    scaling; amaxes are recorded while gradients are (training, not evaluation)."""
    fuse = fuses_wgrad(weight, fuse_wgrad)
    record = torch.is_grad_enabled()
    return _Fp8Linear.apply(x, weight, bias, GRAD_DTYPES[fp8_format], fuse, sites, record)
