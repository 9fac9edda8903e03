"""The linear layer every mega model and parallel plugin calls, with Megatron's gradient
accumulation fusion (``--gradient-accumulation-fusion``, on by default).

Without fusion, backward writes each weight's gradient in the model's dtype and a hook then adds
it into the fp32 ``main_grad`` of the :class:`~mega.parallel.data.grad_buffer.ParamAndGradBuffer`: for a
bf16 1.3B model that is 2.6 GB written, read again, and 10 GB of fp32 read-modify-write per
micro-batch. Fused, the weight-gradient GEMM accumulates straight into ``main_grad`` in fp32
(``addmm`` with an fp32 output on CUDA; cuBLAS reads and writes C once, inside the GEMM), and on a
step's first micro-batch it overwrites instead (beta 0), so the buffer needs no zeroing.

A weight opts in by carrying ``fuse_wgrad = True`` and a ``main_grad`` (the engine marks them; the
buffer registers it). Autograd still sees a gradient for it, an uninitialised placeholder, so that
the buffer's post-accumulate hook runs as usual and counts the gradient for overlapped reduction;
the ``grad_added_to_main_grad`` flag tells the hook not to add it (Megatron's mechanism).

The GEMM runs inside the custom op ``mega::weight_grad``, which ``torch.compile`` treats as one
opaque call: a compiled layer stays one graph, forward and backward, with its bias gradients fused
into the neighbouring kernels. (Behind ``torch.compiler.disable`` each linear broke the layer's
graph; on an H100 that cost 8% of a 1.3B GPT's step in host time.)

Inside :func:`deferring_weight_grads` a fused weight's GEMM is not run by backward but queued, with
the tensors it reads, for :meth:`WeightGradQueue.run`: the zero-bubble pipeline schedules compute a
chunk's input gradient first, send it, and do the weight gradients while the transfer is in flight.
The placeholder is then marked ``wgrad_deferred`` and the hook ignores it; the queue tells the
buffer when ``main_grad`` is written (``notify_main_grad``, set by the buffer), so overlapped
reduction still counts it. The op looks for a queue when it runs, not when it is traced.
"""

from __future__ import annotations

import weakref
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


# data pointer -> the parameter whose data it is (see register_fused_weight)
_owners: dict[int, weakref.ref] = {}


def register_fused_weight(param: torch.nn.Parameter) -> None:
    """Let the weight-gradient op find ``param`` (its ``main_grad`` and flags) from its data.
    Inside a compiled graph the op is handed the weight's tensor, not the Parameter object that
    carries the attributes. Call it once the parameter's data has its final place (the buffer)."""
    key = param.data_ptr()

    def forget(ref: weakref.ref) -> None:  # unless a newer parameter took the address
        if _owners.get(key) is ref:
            del _owners[key]

    _owners[key] = weakref.ref(param, forget)


def _owner(weight: torch.Tensor) -> torch.nn.Parameter:
    ref = _owners.get(weight.data_ptr())
    param = ref() if ref is not None else None
    if param is None or param.data_ptr() != weight.data_ptr():
        raise RuntimeError(
            "a weight marked fuse_wgrad is not registered with a gradient buffer "
            "(mega.parallel.linear.register_fused_weight)"
        )
    return param


@torch.library.custom_op("mega::weight_grad", mutates_args=())
def _weight_grad(
    grad_2d: torch.Tensor, inputs_2d: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The fused weight gradient, as one op that torch.compile leaves opaque: it runs the GEMM
    into ``main_grad`` (or queues it) and returns the placeholder gradient that autograd hands the
    weight. Declared pure on purpose: what it writes (``main_grad``, the flags) is read by nothing
    inside a compiled graph, and its result is used, so the compiler neither drops nor reorders
    it across its inputs. As an op rather than a disabled function it costs the layer's compiled
    graph no break, forward or backward: a break measured about 250 us of host time per linear."""
    param = _owner(weight)
    if _queue is not None and hasattr(param, "notify_main_grad"):
        _queue.add(param, grad_2d, inputs_2d)
        param.wgrad_deferred = True  # the buffer's hook ignores this placeholder
    else:
        _accumulate_into(param, grad_2d, inputs_2d)
    return torch.empty_like(weight)


@_weight_grad.register_fake
def _(grad_2d: torch.Tensor, inputs_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(weight)


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with the weight gradient fused into ``weight.main_grad`` when the weight has
    opted in (``fuse_wgrad``) and gradients are being recorded."""
    if getattr(weight, "fuse_wgrad", False) and torch.is_grad_enabled() and weight.requires_grad:
        return _LinearAccumulatingWgrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward goes through :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
