"""The linear layer every mega model and parallel plugin calls, with Megatron's gradient
accumulation fusion (``--gradient-accumulation-fusion``, on by default).

Without fusion, backward writes each weight's gradient in the model's dtype and a hook then adds
it into the fp32 ``main_grad`` of the :class:`~mega.core.grad_buffer.ParamAndGradBuffer`: for a
bf16 1.3B model that is 2.6 GB written, read again, and 10 GB of fp32 read-modify-write per
micro-batch. Fused, the weight-gradient GEMM accumulates straight into ``main_grad`` in fp32
(``addmm`` with an fp32 output on CUDA; cuBLAS reads and writes C once, inside the GEMM), and on a
step's first micro-batch it overwrites instead (beta 0), so the buffer needs no zeroing.

A weight opts in by carrying ``fuse_wgrad = True`` and a ``main_grad`` (the engine marks them).
Autograd still sees a gradient for it, an uninitialised placeholder, so that the buffer's
post-accumulate hook runs as usual and counts the gradient for overlapped reduction; the
``grad_added_to_main_grad`` flag tells the hook not to add it (Megatron's mechanism).

Inside :func:`deferring_weight_grads` a fused weight's GEMM is not run by backward but queued, with
the tensors it reads, for :meth:`WeightGradQueue.run`: the zero-bubble pipeline schedules compute a
chunk's input gradient first, send it, and do the weight gradients while the transfer is in flight.
Autograd then sees no gradient for the weight; the queue tells the buffer when ``main_grad`` is
written (``notify_main_grad``, set by the buffer), so overlapped reduction still counts it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


def accumulate_wgrad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor, overwrite: bool
) -> None:
    """``main_grad (+)= grad_output^T @ inputs`` in fp32; both operands are ``[tokens, features]``."""
    beta = 0.0 if overwrite else 1.0
    if main_grad.is_cuda and grad_output.dtype != torch.float32:
        torch.addmm(
            main_grad,
            grad_output.t(),
            inputs,
            beta=beta,
            out_dtype=torch.float32,
            out=main_grad,
        )
    else:  # CPU, or fp32 parameters: an fp32 addmm in place
        main_grad.addmm_(grad_output.t().float(), inputs.float(), beta=beta)


class WeightGradQueue:
    """Weight-gradient GEMMs that backward left for later, in the order backward reached them."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, weight: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
        self._items.append((weight, grad_output, inputs))

    @torch.no_grad()  # as inside backward: main_grad is a view made without autograd
    def run(self) -> None:
        """Accumulate every queued GEMM into its weight's ``main_grad``, then tell the buffer."""
        items, self._items = self._items, []
        for weight, grad_output, inputs in items:
            _accumulate_into(weight, grad_output, inputs)
            notify = getattr(weight, "notify_main_grad", None)
            if notify is not None:
                notify(weight)


_queue: WeightGradQueue | None = None  # set while a backward defers its weight gradients


@contextmanager
def deferring_weight_grads() -> Iterator[WeightGradQueue]:
    """Inside, fused linears queue their weight-gradient GEMMs (with the activation and output
    gradient they read, kept alive until then) instead of running them; run the queue later."""
    global _queue
    outer, _queue = _queue, WeightGradQueue()
    try:
        yield _queue
    finally:
        _queue = outer


def _accumulate_into(weight: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    accumulate_wgrad(
        weight.main_grad, grad_output, inputs, overwrite=getattr(weight, "main_grad_fresh", False)
    )
    weight.main_grad_fresh = False
    weight.grad_added_to_main_grad = True


class _LinearAccumulatingWgrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        # the parameter itself, not a saved copy: under activation recompute saved tensors come
        # back as new objects, without the main_grad attribute
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        grad_input = grad_output.matmul(weight)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, out]
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        if _queue is not None and hasattr(weight, "notify_main_grad"):
            _queue.add(weight, grad_2d, x.reshape(-1, x.shape[-1]))
            return grad_input, None, grad_bias  # no gradient now: the queue reports it later
        _accumulate_into(weight, grad_2d, x.reshape(-1, x.shape[-1]))
        # a placeholder, so that AccumulateGrad runs the buffer's hook for this weight
        grad_weight = torch.empty_like(weight)
        return grad_input, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with the weight gradient fused into ``weight.main_grad`` when the weight has
    opted in (``fuse_wgrad``) and gradients are being recorded."""
    if getattr(weight, "fuse_wgrad", False) and torch.is_grad_enabled() and weight.requires_grad:
        # The bias stays inside: the GEMM adds it for free, and in a compiled layer a separate
        # add measured slower (the opaque call splits the graph, so it did not fuse).
        return _fused_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.compiler.disable  # its backward writes into main_grad: an opaque call, not a traced op
def _fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _LinearAccumulatingWgrad.apply(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward goes through :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
