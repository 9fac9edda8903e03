"""AdamW over fp32 master weights, with fp32 gradient accumulation and loss scaling.

fp32 runs: the model's parameters are the master weights and ``.grad`` accumulates in fp32.

bf16/fp16 runs (Megatron's mixed precision): each low-precision parameter has an fp32 master copy
and an fp32 ``main_grad``. A post-accumulate-grad hook adds every micro-batch's low-precision
``.grad`` into ``main_grad`` and frees it, so accumulation across micro-batches happens in fp32.
The step unscales (fp16), skips on inf/NaN, clips the global norm, runs AdamW on the masters and
copies them back into the model's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mega.core.loss_scaler import ConstantLossScaler, DynamicLossScaler, unscale_


class NonFiniteGradients(ArithmeticError):
    """NaN or inf in the gradients of a run without a loss scaler (fp32, bf16)."""


@dataclass
class StepOutcome:
    skipped: bool  # the loss scaler found inf/NaN gradients and the update was not applied
    grad_norm: torch.Tensor | None  # global norm before clipping (device tensor, no host sync)


def _uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: no weight decay on biases and norm weights (the 1-D parameters)."""
    return param.ndim >= 2


def build_loss_scaler(precision: Any) -> ConstantLossScaler | DynamicLossScaler | None:
    """fp16 needs a loss scale (static with --loss-scale, else dynamic); bf16 and fp32 do not."""
    if not precision.fp16:
        return None
    if precision.loss_scale is not None:
        return ConstantLossScaler(precision.loss_scale)
    return DynamicLossScaler(
        initial_scale=precision.initial_loss_scale,
        min_scale=precision.min_loss_scale,
        growth_interval=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )


class MixedPrecisionAdamW:
    """AdamW whose state and update live in fp32, whatever the model's parameter dtype."""

    def __init__(self, model: torch.nn.Module, optim: Any, precision: Any):
        self.clip_grad = optim.clip_grad
        self.scaler = build_loss_scaler(precision)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:
            self.masters = [p.detach().float().clone() for p in self.params]
            for param, master in zip(self.params, self.masters, strict=True):
                master.main_grad = torch.zeros_like(master)
                param.register_post_accumulate_grad_hook(self._accumulate_into(master))
        else:
            self.masters = self.params
        decay = [
            m for (n, p), m in zip(named, self.masters, strict=True) if _uses_weight_decay(n, p)
        ]
        no_decay = [
            m for (n, p), m in zip(named, self.masters, strict=True) if not _uses_weight_decay(n, p)
        ]
        on_cuda = self.params[0].is_cuda if self.params else False
        self.adam = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2),
            eps=optim.adam_eps,
            fused=on_cuda,
            foreach=None if on_cuda else True,
        )

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            master.main_grad.add_(param.grad)  # fp32 += low precision, upcast on the fly
            param.grad = None

        return hook

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _grads(self) -> list[torch.Tensor]:
        if self.mixed:
            return [m.main_grad for m in self.masters]
        return [p.grad for p in self.params if p.grad is not None]

    def zero_grad(self) -> None:
        if self.mixed:
            for master in self.masters:
                master.main_grad.zero_()
                master.grad = None
        for param in self.params:
            param.grad = None

    def step(self, lr: float) -> StepOutcome:
        grads = self._grads()
        if self.scaler is not None:
            found_inf = unscale_(grads, 1.0 / self.scaler.scale)
            overflow = bool(found_inf.item())  # one host sync per step, as in Megatron's fp16
            self.scaler.update(overflow)
            if overflow:
                self.zero_grad()
                return StepOutcome(skipped=True, grad_norm=None)
        if self.mixed:
            for master in self.masters:
                master.grad = master.main_grad
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else None
        if self.scaler is None and grad_norm is not None and not torch.isfinite(grad_norm):
            # Megatron's default (--check-for-nan-in-loss-and-grad): stop, do not apply NaNs.
            # One host sync per step; fp16 already syncs for its overflow check above.
            self.zero_grad()
            raise NonFiniteGradients(f"the gradient norm is {float(grad_norm)}")
        if self.clip_grad > 0 and grad_norm is not None:
            # clip on the device with the norm just computed: no host sync
            torch.nn.utils.clip_grads_with_norm_(
                self.masters, self.clip_grad, grad_norm, foreach=True
            )
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        self.zero_grad()
        return StepOutcome(skipped=False, grad_norm=grad_norm)

    def state_dict(self) -> dict[str, Any]:
        state = {"adam": self.adam.state_dict()}
        if self.mixed:
            state["masters"] = [m.detach().clone() for m in self.masters]
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adam.load_state_dict(state["adam"])
        if self.mixed:
            with torch.no_grad():
                for master, saved in zip(self.masters, state["masters"], strict=True):
                    master.copy_(saved)
                torch._foreach_copy_(self.params, self.masters)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
