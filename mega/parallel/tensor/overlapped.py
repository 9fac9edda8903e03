"""The column-parallel linear as one autograd function whose backward hides its communication
behind its GEMMs (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``).

Built from the mappings (``copy_to_tensor_parallel`` or ``gather_from_sequence``, then the GEMM),
backward runs the input-gradient GEMM, the weight-gradient GEMM, and only then the collective
that the input gradient needs: nothing runs beside it. Here backward starts that collective as
soon as the input gradient exists and computes the weight gradient while it is in flight:

- tensor parallel: ``dX = dY W`` -> start the all-reduce of dX -> ``dW = dY^T X`` -> wait;
- sequence parallel: start the all-gather of the saved token block X_r -> ``dX = dY W`` -> start
  the reduce-scatter of dX -> wait for X -> ``dW = dY^T X`` -> wait for dX_r.

With ``MEGA_TP_SPLIT_OVERLAP=copy-engine`` the copy engine carries them instead of NCCL
(:mod:`.copy_engine_split` under sequence parallelism, :mod:`.copy_engine_reduce` without).

Under sequence parallelism forward saves the rank's token block, not the gathered input: the
gathered copy (``[b, s, h]`` per column-parallel layer) is not held from forward to backward,
which is what makes sequence parallelism save memory; backward gathers it again, in the shadow
of the input-gradient GEMM.

Backward is one opaque custom op (``mega::column_parallel_backward``), so that a compiled layer
keeps this order. Written as traced functional collectives, it did not survive inductor (CPU,
torch 2.13, checked in the generated code): the reduce-scatter's wait was placed straight after
it, before the weight-gradient GEMM, and the backward all-gather was merged with the forward's,
whose result was then saved from forward to backward. Inside the op the collectives are c10d's,
asynchronous (on CUDA the compute stream waits for NCCL's; the host does not). The weight
gradient is fused into ``main_grad`` where the weight opted in (:mod:`mega.parallel.weight_grad`),
deferred under the zero-bubble schedules as before.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.parallel.comm import all_gather_into, reduce_scatter_into
from mega.parallel.functional_comm import start_all_gather, wait
from mega.parallel.linear import fuses_wgrad
from mega.parallel.tensor import copy_engine_reduce, copy_engine_split, split_overlap
from mega.parallel.tensor.split_overlap import column_split_forward
from mega.parallel.weight_grad import OpaqueWhenTraced, weight_gradient


def _gathered(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """``[b, s/tp, h]`` token blocks of every rank as ``[b, s, h]`` (block ``r`` of the flat
    tokens from rank ``r``: ``mega.parallel.tensor.mappings``' layout)."""
    flat = wait(start_all_gather(x.reshape(-1, x.shape[-1]), size, name))
    return flat.view(x.shape[0], -1, x.shape[-1])


def _column_parallel_backward_body(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    name: str,
    size: int,
    sequence_parallel: bool,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX ``x``'s shape, dW or the fused placeholder), the collectives overlapped as the module
    docstring says. Declared pure for the reason ``mega::weight_grad`` is."""
    group = _resolve_process_group(name)
    x_2d = x.reshape(-1, x.shape[-1]).contiguous()
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [tokens, out]
    if split_overlap.by_copy_engine(group, x_2d):  # MEGA_TP_SPLIT_OVERLAP=copy-engine
        wgrad = partial(weight_gradient, weight, fused=fused)
        carrier = copy_engine_split if sequence_parallel else copy_engine_reduce
        grad_x, grad_weight = carrier.column_backward(grad_2d, x_2d, weight, group, wgrad)
        return grad_x.view(x.shape), grad_weight
    gathering = None
    inputs = x_2d
    if sequence_parallel:  # X travels while dX is computed
        inputs = x_2d.new_empty(x_2d.shape[0] * size, x_2d.shape[1])
        gathering = all_gather_into(inputs, x_2d, group, async_op=True)
    grad_in = grad_2d.mm(weight)  # [tokens, in], this rank's share
    if sequence_parallel:
        grad_x = grad_in.new_empty(x_2d.shape)
        reducing = reduce_scatter_into(grad_x, grad_in, group, async_op=True)
    else:
        grad_x = grad_in
        reducing = dist.all_reduce(grad_x, group=group, async_op=True)
    if gathering is not None:
        gathering.wait()
    grad_weight = weight_gradient(weight, grad_2d, inputs, fused)  # while dX travels
    reducing.wait()
    return grad_x.view(x.shape), grad_weight


_column_parallel_backward = OpaqueWhenTraced(
    "mega::column_parallel_backward", _column_parallel_backward_body
)


@_column_parallel_backward.op.register_fake
def _(grad_out, x, weight, name, size, sequence_parallel, fused):  # noqa: ANN001, ANN202
    return torch.empty_like(x), torch.empty_like(weight)


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        name: str,
        size: int,
        sequence_parallel: bool,
        fused: bool,
        split: bool,
    ):  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        ctx.args = (name, size, sequence_parallel, fused)
        ctx.has_bias = bias is not None
        return column_parallel_linear(x, weight, bias, name, size, sequence_parallel, split)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = _column_parallel_backward(grad_out, x, weight, *ctx.args)
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    name: str,
    size: int,
    sequence_parallel: bool,
    split: bool = False,
) -> torch.Tensor:
    """``[b, s, out/tp]`` of the column-parallel GEMM on ``x`` (``[b, s, in]`` replicated, or
    this rank's ``[b, s/tp, in]`` token block under sequence parallelism) over the group
    ``name`` of ``size`` ranks, its backward overlapped as the module docstring says;
    ``split``: forward's gather too, by token blocks (:mod:`.split_overlap`)."""
    if torch.is_grad_enabled():
        fused = fuses_wgrad(weight)
        args = (x, weight, bias, name, size, sequence_parallel, fused, split)
        return _ColumnParallelLinear.apply(*args)
    # no backward to overlap (or inside the function's forward, where grad is off): the forward
    if sequence_parallel and split:  # the gather hidden behind the own block's rows
        return column_split_forward(x, weight, bias, name, size)
    full = _gathered(x, size, name) if sequence_parallel else x
    return F.linear(full, weight, bias)
