"""Losses computed inside the forward pass (the MoE router's load-balancing and z losses).

They never reach the loss the schedule calls backward on: ``attach(x, loss)`` returns ``x``
unchanged and, in backward, gives ``loss`` the gradient the main loss of the same micro-batch
gets: the executor's ``grad_scale / num_microbatches`` (Megatron's ``MoEAuxLossAutoScaler``).
That works across pipeline stages, where the main loss lives on another rank.

The scale is process-wide (one training step runs at a time in a process): the executor sets it
before each step's forward passes with :func:`set_backward_scale`.
"""

from __future__ import annotations

import torch

_scale = {"value": 1.0}


def set_backward_scale(scale: float) -> None:
    """The factor the main loss of every micro-batch is multiplied by before backward."""
    _scale["value"] = float(scale)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.full(ctx.loss_shape, _scale["value"], dtype=ctx.loss_dtype)
        return grad, scale.to(ctx.loss_device)


def attach(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``x``, carrying ``loss`` into backward (see the module docstring)."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return x
    return _Attach.apply(x, loss)
