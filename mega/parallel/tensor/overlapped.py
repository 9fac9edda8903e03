"""The column-parallel linear as one autograd function whose backward hides its communication
behind its GEMMs (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``).

Built from the mappings (``copy_to_tensor_parallel`` or ``gather_from_sequence``, then the GEMM),
backward runs the input-gradient GEMM, the weight-gradient GEMM, and only then the collective
that the input gradient needs: nothing runs beside it. Here backward starts that collective as
soon as the input gradient exists and computes the weight gradient while it is in flight:

- tensor parallel: ``dX = dY W`` -> start the all-reduce of dX -> ``dW = dY^T X`` -> wait;
- sequence parallel: start the all-gather of the saved token block X_r -> ``dX = dY W`` -> start
  the reduce-scatter of dX -> wait for X -> ``dW = dY^T X`` -> wait for dX_r.

Under sequence parallelism forward saves the rank's token block, not the gathered input: the
gathered copy (``[b, s, h]`` per column-parallel layer) is no longer held from forward to
backward, which is what makes sequence parallelism save memory; backward gathers it again, in
the shadow of the input-gradient GEMM. The collectives are the raw functional ones
(:mod:`mega.parallel.functional_comm`), so the waits stay where they are written when the layer
is compiled. The weight gradient is fused into ``main_grad`` where the weight opted in
(:mod:`mega.parallel.weight_grad`), deferred under the zero-bubble schedules as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mega.parallel.functional_comm import (
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
    wait,
)
from mega.parallel.linear import fuses_wgrad, weight_gradient


def _gathered(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """``[b, s/tp, h]`` token blocks of every rank as ``[b, s, h]`` (block ``r`` of the flat
    tokens from rank ``r``: ``mega.parallel.tensor.mappings``' layout)."""
    flat = wait(start_all_gather(x.reshape(-1, x.shape[-1]), size, name))
    return flat.view(x.shape[0], -1, x.shape[-1])


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, name: str, size: int, sequence_parallel: bool, fused: bool):  # noqa: ANN001
        full = _gathered(x, size, name) if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        ctx.name, ctx.size, ctx.sp, ctx.fused = name, size, sequence_parallel, fused
        ctx.has_bias = bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        x, weight = ctx.saved_tensors
        name, size = ctx.name, ctx.size
        needs_input, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathering = None
        if ctx.sp and needs_weight:  # X travels while dX is computed
            gathering = start_all_gather(x.reshape(-1, x.shape[-1]), size, name)
        reducing = None
        if needs_input:
            grad_in = grad_out.matmul(weight)  # [b, s, in], this rank's share
            if ctx.sp:
                reducing = start_reduce_scatter(grad_in.reshape(-1, grad_in.shape[-1]), size, name)
            else:
                reducing = start_all_reduce(grad_in, name)
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [tokens, out]
        grad_weight = grad_bias = None
        if needs_weight:  # while dX travels
            inputs = wait(gathering) if gathering is not None else x.reshape(-1, x.shape[-1])
            grad_weight = weight_gradient(grad_2d, inputs, weight, ctx.fused)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        grad_x = None
        if reducing is not None:
            grad_x = wait(reducing).view(x.shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    name: str,
    size: int,
    sequence_parallel: bool,
) -> torch.Tensor:
    """``[b, s, out/tp]`` of the column-parallel GEMM on ``x`` (``[b, s, in]`` replicated, or
    this rank's ``[b, s/tp, in]`` token block under sequence parallelism) over the group
    ``name`` of ``size`` ranks, its backward overlapped as the module docstring says."""
    if not torch.is_grad_enabled():  # no backward to overlap: the forward alone
        full = _gathered(x, size, name) if sequence_parallel else x
        return F.linear(full, weight, bias)
    fused = fuses_wgrad(weight)
    return _ColumnParallelLinear.apply(x, weight, bias, name, size, sequence_parallel, fused)
