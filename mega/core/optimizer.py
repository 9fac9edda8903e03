"""AdamW over fp32 master weights and fp32 gradients, optionally sharded over data-parallel ranks.

Gradients arrive in the ``main_grad`` views of a :class:`ParamAndGradBuffer`, already reduced over
the data-parallel ranks. The optimizer updates the slices of the parameters this rank owns: all of
them, or with the distributed optimizer (``--use-distributed-optimizer``) its 1/DP shard of every
bucket, whose fp32 masters and Adam state are the only ones it keeps.

fp32 runs: the masters are views of the parameters themselves. bf16/fp16 runs (Megatron's mixed
precision): the masters are fp32 copies, written back into the low-precision parameters after
each step. A step unscales (fp16), skips on inf/NaN, clips the global norm (summed over every
model-parallel and, sharded, data-parallel rank, each parameter counted once), runs AdamW and,
sharded, all-gathers the updated parameters.

Without a loss scaler (fp32, bf16) a step never waits for the GPU: clipping is folded into the
fused AdamW kernel (it divides each gradient by ``grad_scale``, the clip factor's inverse) instead
of a separate pass over the gradients, and a NaN or inf norm sets the kernel's ``found_inf``, which
skips the update on the device. The first such step is remembered on the device and reported by
:meth:`MixedPrecisionAdamW.first_nonfinite` whenever the engine syncs anyway (iteration lines,
checkpoints, the end of training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mega.core import comm
from mega.core.grad_buffer import ParamAndGradBuffer
from mega.core.loss_scaler import ConstantLossScaler, DynamicLossScaler, unscale_


@dataclass
class StepOutcome:
    skipped: bool  # the loss scaler found inf/NaN gradients and the update was not applied
    grad_norm: torch.Tensor | None  # global norm before clipping (device tensor, no host sync)


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

    def __init__(self, buffer: ParamAndGradBuffer, optim: Any, precision: Any):
        self.buffer = buffer
        self.topology = buffer.topology
        self.clip_grad = optim.clip_grad
        self.scaler = build_loss_scaler(precision)
        self.mixed = buffer.param_data.dtype != torch.float32
        # (parameter, lo, hi): the flat slice of each parameter that this rank updates
        self.pieces = pieces = buffer.owned_ranges()
        self.param_pieces = [p.data.view(-1)[lo:hi] for p, lo, hi in pieces]
        self.grads = [p.main_grad.view(-1)[lo:hi] for p, lo, hi in pieces]
        if self.mixed:
            self.masters = [piece.detach().float().clone() for piece in self.param_pieces]
        else:
            self.masters = self.param_pieces  # fp32: update the parameters in place
        # A parameter replicated over the tensor-parallel ranks counts once in the gradient norm,
        # and so does a tied weight two pipeline stages hold (on the first stage).
        tp_rank = self.topology.tp_rank
        self._in_norm = [
            (tp_rank == 0 or hasattr(p, "shard")) and not getattr(p, "tied_copy", False)
            for p, _, _ in pieces
        ]
        decay = [m for (p, _, _), m in zip(pieces, self.masters, strict=True) if p.ndim >= 2]
        no_decay = [m for (p, _, _), m in zip(pieces, self.masters, strict=True) if p.ndim < 2]
        # Megatron's rule: no weight decay on biases and norm weights (the 1-D parameters)
        self.adam = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=(optim.adam_beta1, optim.adam_beta2),
            eps=optim.adam_eps,
            fused=True,  # one kernel per group of tensors, with grad_scale and found_inf
        )
        device = buffer.main_grad.device
        # (iteration, gradient norm) of the first step whose norm was not finite; -1: none yet
        self._first_bad_iteration = torch.full((), -1, dtype=torch.int64, device=device)
        self._first_bad_norm = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """Combine a per-rank partial result over every rank that holds other gradients."""
        if self.buffer.distributed:
            comm.all_reduce(tensor, self.topology.group("dp"), op)
        comm.all_reduce(tensor, self.topology.group("mp"), op)

    def _grad_norm(self) -> torch.Tensor:
        counted = [g for g, keep in zip(self.grads, self._in_norm, strict=True) if keep]
        if self.topology.world_size == 1:
            return torch.nn.utils.get_total_norm(counted, foreach=True)
        if counted:
            local = torch.nn.utils.get_total_norm(counted, foreach=True)
        else:
            local = torch.zeros((), device=self.buffer.main_grad.device)
        squared = local.double().square().reshape(1)
        self._reduce(squared)
        return squared.sqrt().float().reshape(())

    def _release_grads(self) -> None:
        # main_grad itself is not zeroed: the next step's first gradients overwrite it
        for master in self.masters:
            master.grad = None

    def step(self, lr: float, iteration: int = 0) -> StepOutcome:
        """Apply the reduced gradients (call ``buffer.finish_grad_sync()`` first). ``iteration``
        is what :meth:`first_nonfinite` reports if this step's gradients are not finite."""
        if self.scaler is not None:
            found_inf = unscale_(self.grads, 1.0 / self.scaler.scale).float().reshape(1)
            self._reduce(found_inf, comm.MAX)
            overflow = bool(found_inf.item())  # one host sync per step, as in Megatron's fp16
            self.scaler.update(overflow)
            if overflow:
                self._release_grads()
                return StepOutcome(skipped=True, grad_norm=None)
        for master, grad in zip(self.masters, self.grads, strict=True):
            master.grad = grad
        grad_norm = self._grad_norm()
        bad = ~torch.isfinite(grad_norm)
        if self.scaler is None:
            # Megatron's --check-for-nan-in-loss-and-grad, without its per-step host sync: the
            # update is skipped on the device (found_inf) and the engine stops at its next sync
            first = bad & (self._first_bad_iteration < 0)
            self._first_bad_iteration = torch.where(first, iteration, self._first_bad_iteration)
            self._first_bad_norm = torch.where(first, grad_norm, self._first_bad_norm)
        self.adam.found_inf = bad.float()
        # clipping by total norm, Megatron's factor max_norm / (norm + 1e-6) capped at 1, applied
        # by the fused kernel as a division by its inverse: no extra pass over the gradients
        self.adam.grad_scale = (
            torch.clamp((grad_norm.float() + 1e-6) / self.clip_grad, min=1.0)
            if self.clip_grad > 0
            else None
        )
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.param_pieces, self.masters)
        self.buffer.gather_params()
        self._release_grads()
        return StepOutcome(skipped=False, grad_norm=grad_norm)

    def first_nonfinite(self) -> tuple[int, float] | None:
        """(iteration, gradient norm) of the first step skipped for a NaN or inf gradient norm
        without a loss scaler, or None. Waits for the GPU: call it where the engine syncs anyway."""
        iteration = int(self._first_bad_iteration)
        return (iteration, float(self._first_bad_norm)) if iteration >= 0 else None

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam's moments plus separate fp32 masters."""
        total = sum(
            t.numel() * t.element_size()
            for state in self.adam.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
        if self.mixed:
            total += sum(m.numel() * m.element_size() for m in self.masters)
        return total

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
                    master.copy_(saved.reshape(master.shape))
                torch._foreach_copy_(self.param_pieces, self.masters)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
