"""One SGD-with-momentum update over flat fp32 buffers (``--optimizer sgd``), in the shape of
:func:`mega.parallel.data.flat_adamw.adamw_flat_` (the contract of
:class:`mega.parallel.data.rules.OptimizerSpec`).

The formulas are ``torch.optim.SGD``'s, which Megatron builds for ``--optimizer sgd`` (momentum
``--sgd-momentum``, dampening 0, no Nesterov): weight decay is added to the gradient (L2, not
decoupled), the momentum buffer starts as the first gradient, and the step is ``lr * buffer``.
"""

from __future__ import annotations

import torch


def sgd_flat_(
    master: torch.Tensor,
    grad: torch.Tensor,
    states: tuple[torch.Tensor],
    lowp: torch.Tensor | None,
    *,
    lr: torch.Tensor,
    weight_decay: float,
    momentum: float,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
) -> None:
    """Update ``master`` and the momentum buffer (``states``: the one tensor) in place; ``step``
    counts applied steps, this one included (1 on the first). Where ``skip`` is true nothing
    changes."""
    (momentum_buffer,) = states
    g = grad / grad_scale + weight_decay * master
    new_buf = torch.where(step <= 1.0, g, momentum * momentum_buffer.float() + g)
    new_master = torch.where(skip, master, master - lr * new_buf)
    momentum_buffer.copy_(torch.where(skip, momentum_buffer, new_buf))
    master.copy_(new_master)
    if lowp is not None:
        lowp.copy_(new_master)
