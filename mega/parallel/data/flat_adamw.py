"""One AdamW update over flat fp32 buffers, that also writes the low-precision parameters.

PyTorch's fused AdamW takes a list of tensors and updates fp32 masters; copying them into the bf16
parameters is a second pass. Here the whole update (decoupled weight decay, both moments, bias
correction, the clip factor, the skip on a non-finite gradient norm, and the bf16 copy) is one
elementwise expression over contiguous slices of flat buffers: compiled on a GPU it is a single
kernel that reads master, gradient and moments once and writes them once, 30 bytes a parameter.

Every scalar that changes between steps (learning rate, step count, clip factor, skip flag) is a
0-d device tensor, so that neither the compiled kernel recompiles nor the step waits for the host.
Its formulas are those of ``torch.optim.AdamW``'s fused kernel (agreement to rounding: tests).
"""

from __future__ import annotations

import torch


def adamw_flat_(
    master: torch.Tensor,
    grad: torch.Tensor,
    states: tuple[torch.Tensor, torch.Tensor],
    lowp: torch.Tensor | None,
    *,
    lr: torch.Tensor,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
) -> None:
    """Update ``master`` and both moments (``states``: ``exp_avg``, ``exp_avg_sq``, fp32 or, under
    --use-precision-aware-optimizer, bf16/fp16: computed in fp32 either way) in place (``step``
    is the step number after this one, as a float tensor); write the result into ``lowp`` too
    unless it is None. Where ``skip`` is true nothing changes."""
    exp_avg, exp_avg_sq = states
    g = grad / grad_scale  # the clip factor's inverse, 1 when not clipping
    decayed = master - lr * weight_decay * master
    new_avg = beta1 * exp_avg.float() + (1.0 - beta1) * g
    new_avg_sq = beta2 * exp_avg_sq.float() + (1.0 - beta2) * g * g
    step_size = lr / (1.0 - torch.pow(beta1, step))
    denom = torch.sqrt(new_avg_sq) / torch.sqrt(1.0 - torch.pow(beta2, step)) + eps
    new_master = decayed - step_size * new_avg / denom
    new_master = torch.where(skip, master, new_master)
    exp_avg.copy_(torch.where(skip, exp_avg, new_avg))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, new_avg_sq))
    master.copy_(new_master)
    if lowp is not None:
        lowp.copy_(new_master)
