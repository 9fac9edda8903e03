"""Megatron's parameter initialisation, drawn per parameter from (seed, name) so that it does not
depend on the parallel layout; every model family's ``reset_parameters`` calls it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mega.core.training.init import normal_

RESIDUAL_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")  # each residual branch's last


@torch.no_grad()
def megatron_init_(
    model: nn.Module, seed: int, std: float, residual_std: Callable[[str], float]
) -> None:
    """Megatron's init of every parameter of ``model``, each drawn from (seed, its name) so the
    values do not depend on the layout: biases 0, norm weights 1, the residual branches' output
    weights N(0, ``residual_std(name)``) (Megatron: std / sqrt(2 x layers)), the rest N(0, std).
    The GPT, BERT and T5 models share it."""
    norms = {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm | nn.RMSNorm)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif name in norms:
            param.fill_(1.0)
        elif name.endswith(RESIDUAL_OUTPUTS):
            normal_(param, std=residual_std(name), seed=seed, name=name)
        else:
            normal_(param, std=std, seed=seed, name=name)
