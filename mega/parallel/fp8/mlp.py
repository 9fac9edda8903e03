"""FC1, GeLU, FC2 of an MLP whose two linears are FP8, as one autograd function: the same GEMMs as
two :func:`mega.parallel.fp8.linear.fp8_linear` calls around ``F.gelu``, but the GeLU's two cast
sites (FC2's input, FC1's output gradient) are the fused passes of
``mega.parallel.fp8.gelu_cast``, and FC2's input is not kept for backward: the output-gradient
pass writes it again, transposed, while it reads FC1's output anyway.

Tensor parallelism wraps it unchanged: FC1 column-parallel (its input gathered before), FC2
row-parallel (its partial product reduced after, then its bias added), so the function computes
``gelu(x W1^T + b1) W2^T`` on this rank's shards and leaves FC2's bias to the caller.
"""

from __future__ import annotations

import torch

from mega.parallel.fp8.delayed import GRAD, INPUT, Sites, record_amax, to_fp8_at, weight_to_fp8_at
from mega.parallel.fp8.gelu_cast import gelu_grad_to_fp8, gelu_to_fp8
from mega.parallel.fp8.linear import forward_fp8, fuses_wgrad, input_grad_fp8, weight_grad_fp8
from mega.parallel.fp8.scaling import E4M3, GRAD_DTYPES


def _given_scale(sites: Sites | None, site: int) -> torch.Tensor | None:
    """A fused site's delayed scale; None: scale from the amax (current scaling, or seeding)."""
    return sites.scale[site] if sites is not None and sites.seeded else None


def _record(sites: Sites | None, site: int, amax: torch.Tensor, record: bool) -> None:
    if sites is not None and record:
        record_amax(sites, site, amax)


class _Fp8GeluMlp(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        fc1_weight: torch.Tensor,
        fc1_bias: torch.Tensor | None,
        fc2_weight: torch.Tensor,
        grad_dtype: torch.dtype,
        fuse_wgrad: tuple[bool, bool],
        fc2_bias_follows: bool,
        sites: tuple[Sites | None, Sites | None],
        record: bool,
    ) -> torch.Tensor:
        fc1, fc2 = sites
        x_2d = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        x_fp8, x_inverse = to_fp8_at(x_2d, E4M3, fc1, INPUT, record)
        w1_fp8, w1_grad_side, w1_inverse = weight_to_fp8_at(fc1_weight, fc1, record)
        y = forward_fp8(x_fp8, w1_fp8, x_inverse, w1_inverse, x.dtype)  # [tokens, ffn]
        h_fp8, h_scale, h_inverse, h_amax = gelu_to_fp8(y, fc1_bias, E4M3, _given_scale(fc2, INPUT))
        _record(fc2, INPUT, h_amax, record)
        w2_fp8, w2_grad_side, w2_inverse = weight_to_fp8_at(fc2_weight, fc2, record)
        out = forward_fp8(h_fp8, w2_fp8, h_inverse, w2_inverse, x.dtype)  # [tokens, hidden]
        # the weights as the input-gradient GEMMs read them (column-major from a delayed cast)
        ctx.save_for_backward(
            x_fp8, x_inverse, w1_grad_side, w1_inverse, y, fc1_bias, h_scale, h_inverse,
            w2_grad_side, w2_inverse, fc1_weight, fc2_weight,
        )  # fmt: skip
        ctx.grad_dtype, ctx.fuse_wgrad = grad_dtype, fuse_wgrad
        ctx.fc2_bias_follows = fc2_bias_follows
        ctx.sites = sites  # not saved for backward: the casts write their histories in place
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (
            x_fp8, x_inverse, w1_grad_side, w1_inverse, y, fc1_bias, h_scale, h_inverse,
            w2_grad_side, w2_inverse, fc1_weight, fc2_weight,
        ) = ctx.saved_tensors  # fmt: skip
        needs_x, needs_w1, needs_b1, needs_w2 = ctx.needs_input_grad[:4]
        dtype = grad_output.dtype
        fc1, fc2 = ctx.sites
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, hidden]
        # FC2's bias gradient (autograd's, outside) sums the same rows: column amax fuses with it
        g_fp8, g_inverse = to_fp8_at(
            grad_2d, ctx.grad_dtype, fc2, GRAD, True, columns_first=ctx.fc2_bias_follows
        )
        grad_h = input_grad_fp8(g_fp8, w2_grad_side, g_inverse, w2_inverse, dtype)  # [tokens, ffn]
        grad_y, grad_y_t, grad_y_inverse, grad_b1, h_t, grad_y_amax = gelu_grad_to_fp8(
            grad_h, y, fc1_bias, h_scale, ctx.grad_dtype, _given_scale(fc1, GRAD)
        )
        _record(fc1, GRAD, grad_y_amax, True)
        grad_w2 = grad_x = grad_w1 = None
        if needs_w2:
            grad_w2 = weight_grad_fp8(
                g_fp8.t().contiguous(), h_t.t(), g_inverse, h_inverse, fc2_weight, ctx.fuse_wgrad[1]
            )
        if needs_x:
            grad_x = input_grad_fp8(grad_y, w1_grad_side, grad_y_inverse, w1_inverse, dtype)
            grad_x = grad_x.view(*grad_output.shape[:-1], grad_x.shape[-1])
        if needs_w1:
            grad_w1 = weight_grad_fp8(
                grad_y_t, x_fp8, grad_y_inverse, x_inverse, fc1_weight, ctx.fuse_wgrad[0]
            )
        grad_b1 = grad_b1 if needs_b1 else None
        return grad_x, grad_w1, grad_b1, grad_w2, None, None, None, None, None


def fp8_gelu_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias_follows: bool,
    sites: tuple[Sites | None, Sites | None] = (None, None),
) -> torch.Tensor:
    """``F.linear(F.gelu(F.linear(x, fc1_weight, fc1_bias)), fc2_weight)`` with both linears in
    FP8 (their weights' ``fp8_format``, the same for both); weight gradients go into
    ``main_grad`` for weights that fuse them (``fuse_wgrad``). ``fc2_bias_follows``: the caller
    adds FC2's bias to the result (its gradient's row sum then shares a pass with the amax).
    ``sites``: the two linears' delayed scaling (``sites_of``), None for current scaling."""
    fuse = tuple(fuses_wgrad(w, getattr(w, "fuse_wgrad", False)) for w in (fc1_weight, fc2_weight))
    grad_dtype = GRAD_DTYPES[fc1_weight.fp8_format]
    record = torch.is_grad_enabled()
    return _Fp8GeluMlp.apply(
        x, fc1_weight, fc1_bias, fc2_weight, grad_dtype, fuse, fc2_bias_follows, sites, record
    )


def fuses_gelu_mlp(activation: str, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_gelu_mlp` runs this MLP: exact GeLU, both linears FP8 in one format."""
    fmt = getattr(fc1_weight, "fp8_format", None)
    return (
        activation == "gelu" and fmt is not None and fmt == getattr(fc2_weight, "fp8_format", None)
    )
