"""Loss scaling for fp16 training: Megatron-LM's ``DynamicGradScaler`` and ``ConstantGradScaler``.

Megatron (``megatron/core/optimizer/grad_scaler.py``) keeps the scale in a one-element float32
CUDA tensor. Here it is a Python float held on the host, so reading it (to multiply the loss,
to log it) never waits for the GPU; it is rounded to float32 after every change so that it
follows Megatron's float32 arithmetic bit for bit (see :func:`_f32`).

Megatron's hysteresis, as found in its ``DynamicGradScaler.update``:

* an overflow step sets the growth tracker to 0 and decrements the hysteresis tracker; once that
  tracker is <= 0 the scale is multiplied by ``backoff_factor`` (floored at ``min_scale``);
* a clean step only increments the growth tracker. The hysteresis tracker is **not** reset by a
  clean step: it is refilled to ``hysteresis`` only when ``growth_interval`` clean steps in a row
  grow the scale. So "hysteresis consecutive overflows" is loose wording: with hysteresis=2,
  overflow / clean / overflow backs off on the second overflow, and once the tracker has reached
  0 every further overflow backs off again until the next growth.

Megatron's ``train_step`` skips the optimizer step (and the LR scheduler's step) whenever the
gradients held an inf or NaN; :func:`unscale_` gives that flag.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mega.errors import MegaUsageError


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float.

    Megatron stores scale, min_scale and the factors as float32 tensors and multiplies them in
    float32. The product of two float32 values is exact in float64 (24 + 24 < 53 bits), so
    multiplying the rounded Python floats and rounding once gives exactly the float32 product.
    """
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: float32 arithmetic gives inf
        return math.copysign(math.inf, x)


class LossScaler:
    """Common interface: ``scale`` (host float), ``inv_scale``, ``update``, state dicts."""

    _scale: float

    @property
    def scale(self) -> float:
        """The current loss scale: multiply the loss by it before backward."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        # Megatron: scale.double().reciprocal().float(), i.e. 1/scale in double, then float32.
        return _f32(1.0 / self._scale)

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError


class ConstantLossScaler(LossScaler):
    """A fixed scale (Megatron's ``--loss-scale``): never adjusted, whatever the gradients hold."""

    def __init__(self, scale: float) -> None:
        if not scale > 0.0:
            raise MegaUsageError(f"--loss-scale must be > 0, got {scale}")
        self._scale = _f32(float(scale))

    def update(self, found_inf: bool) -> None:
        """No-op: a constant scale ignores overflows (the step is still skipped)."""

    def state_dict(self) -> dict[str, Any]:
        # Megatron's ConstantGradScaler saves nothing: the command line's --loss-scale wins.
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """No-op, as in Megatron."""


class DynamicLossScaler(LossScaler):
    """Megatron's ``DynamicGradScaler``: back off after overflows, grow after clean windows.

    Megatron's flags: ``--initial-loss-scale`` (2**32), ``--min-loss-scale`` (1.0),
    ``--loss-scale-window`` (growth_interval, 1000), ``--hysteresis`` (2); growth 2.0 and
    backoff 0.5 are fixed there.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        # The same checks as Megatron's asserts, as messages naming the flags.
        problems = []
        if not initial_scale > 0.0:
            problems.append(f"--initial-loss-scale must be > 0, got {initial_scale}")
        if not min_scale > 0.0:
            problems.append(f"--min-loss-scale must be > 0, got {min_scale}")
        if min_scale > initial_scale:
            problems.append(
                f"--min-loss-scale ({min_scale}) must not exceed --initial-loss-scale ({initial_scale})"
            )
        if not growth_factor > 1.0:
            problems.append(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            problems.append(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            problems.append(f"--loss-scale-window must be > 0, got {growth_interval}")
        if hysteresis <= 0:
            problems.append(f"--hysteresis must be > 0, got {hysteresis}")
        if problems:
            raise MegaUsageError(problems)

        self._scale = _f32(float(initial_scale))
        self.min_scale = _f32(float(min_scale))
        self.growth_factor = _f32(float(growth_factor))
        self.backoff_factor = _f32(float(backoff_factor))
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Megatron's update, step for step (see the module docstring for the hysteresis)."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            # Not reset here: it keeps going negative, so each further overflow backs off too.
            if self.hysteresis_tracker <= 0:
                self._scale = max(_f32(self._scale * self.backoff_factor), self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                # Only a full clean window refills the hysteresis budget.
                self.hysteresis_tracker = self.hysteresis
                self._scale = _f32(self._scale * self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys, as plain Python numbers (Megatron saves ``scale`` as a tensor)."""
        return {
            "scale": self._scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` output, or a Megatron one whose ``scale`` is a tensor."""
        scale = state["scale"]
        # float() of a 1-element tensor works on any device; a one-off sync at load is fine.
        self._scale = _f32(float(scale.reshape(()) if isinstance(scale, torch.Tensor) else scale))
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def _groups(tensors: Iterable[torch.Tensor | None]) -> dict[tuple[torch.device, torch.dtype], list]:
    # The foreach/AMP kernels want one device (and are fastest with one dtype) per call.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is None or t.numel() == 0:  # empty tensors hold nothing to check
            continue
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _any(flags: list[torch.Tensor]) -> torch.Tensor:
    """OR of 0-dim bool tensors, on the first one's device (no host sync on a single device)."""
    if not flags:
        return torch.tensor(False)
    out = flags[0]
    for f in flags[1:]:
        out = out | f.to(out.device)
    return out


def found_inf_or_nan(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A 0-dim bool tensor: True if any gradient holds an inf or a NaN. Grads are not modified.

    Choice: one ``torch._foreach_norm(group, inf)`` per (device, dtype) group, then ``isfinite``
    over the stacked norms. The infinity norm is max |g|, so it cannot overflow for finite
    values (an L2 norm or a sum of fp16 grads could, giving false alarms), and it propagates
    inf and NaN. It only reads the grads, unlike the AMP unscale kernel, which writes them back;
    and nothing is copied to the host, so the caller decides when to sync (``bool(flag)``), once
    per step, after any all-reduce of the flag. Use :func:`unscale_` when unscaling anyway.
    None entries and empty tensors are skipped; with nothing to check the answer is False (CPU).
    """
    flags = []
    for group in _groups(grads).values():
        norms = torch._foreach_norm(group, math.inf)
        flags.append(~torch.isfinite(torch.stack(norms)).all())
    return _any(flags)


def unscale_(grads: Iterable[torch.Tensor | None], inv_scale: float | torch.Tensor) -> torch.Tensor:
    """Multiply every grad by ``inv_scale`` in place; return a 0-dim bool tensor "found inf/NaN".

    Fused through ``torch._amp_foreach_non_finite_check_and_unscale_`` (the kernel behind
    ``torch.amp.GradScaler`` and Megatron's ``_unscale_main_grads_and_check_for_nan``), one
    call per (device, dtype) group: a single pass over the grads, checking each value before
    scaling it, with no host sync. It runs on CPU (float32, float16, bfloat16) and on CUDA for
    float32 and float16; a group it rejects (bfloat16 on CUDA) takes two passes instead
    (:func:`found_inf_or_nan`, then ``_foreach_mul_``). Pass ``scaler.inv_scale`` to match
    Megatron's float32 reciprocal.
    """
    flags = []
    for (device, _), group in _groups(grads).items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if isinstance(inv_scale, torch.Tensor):
            inv = inv_scale.detach().to(device=device, dtype=torch.float32).reshape(1)
        else:
            inv = torch.full((1,), float(inv_scale), dtype=torch.float32, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
            flags.append(found[0] > 0)
        except NotImplementedError:
            # The CUDA kernel has no bfloat16 (checked on torch 2.11: float32/float16 only);
            # it fails at dispatch, before touching any tensor. Check first, then scale: two
            # passes, still no host sync.
            flags.append(found_inf_or_nan(group))
            torch._foreach_mul_(group, inv.reshape(()))
    return _any(flags)
