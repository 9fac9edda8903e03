"""Losses computed inside the forward pass (the MoE router's load-balancing and z losses).

They never reach the loss the schedule calls backward on: ``attach(x, loss)`` returns ``x``
unchanged and, in backward, gives ``loss`` the gradient the main loss of the same micro-batch
gets: the executor's ``grad_scale / num_microbatches`` (Megatron's ``MoEAuxLossAutoScaler``).
That works across pipeline stages, where the main loss lives on another rank.

The scale is process-wide (one training step runs at a time in a process): the executor sets it
before each step's forward passes with :func:`set_backward_scale`. It is held in a tensor per
device, updated in place, and read in forward: a compiled layer sees it as an input, so a new
scale (fp16's dynamic loss scale, a batch-size ramp-up) reaches its backward without a recompile.
A Python number read in backward would be frozen into the compiled backward graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_value = {"scale": 1.0}
_tensors: dict[torch.device, torch.Tensor] = {}


def set_backward_scale(scale: float, device: torch.device | None = None) -> None:
    """The factor the main loss of every micro-batch is multiplied by before backward; the
    executor names its device, so that the tensor exists before a compiled layer reads it."""
    _value["scale"] = float(scale)
    if device is not None:
        _scale_on(torch.device(device))
    for tensor in _tensors.values():
        tensor.fill_(_value["scale"])


@contextlib.contextmanager
def private_scale() -> Iterator[None]:
    """A scale and tensors of its own while the block runs (``mega plan`` counting a step in a
    process that may have trained: its count must not depend on the devices seen before, and it
    must not change a real run's scale)."""
    global _value, _tensors
    outer = _value, _tensors
    _value, _tensors = {"scale": 1.0}, {}
    try:
        yield
    finally:
        _value, _tensors = outer


def _scale_on(device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _tensors:
        _tensors[device] = torch.full((), _value["scale"], dtype=torch.float32, device=device)
    return _tensors[device]


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.loss_dtype).expand(ctx.loss_shape).clone(), None


def attach(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``x``, carrying ``loss`` into backward (see the module docstring)."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return x
    return _Attach.apply(x, loss, _scale_on(loss.device).clone())
