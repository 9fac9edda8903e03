"""Delayed scaling (``--fp8-recipe delayed``, Transformer Engine's DelayedScaling): each FP8 cast
uses a scale decided before it from the amaxes of earlier steps, so the cast needs no pass over
its tensor first; the tensor's amax is recorded while it is cast, for the steps after.

Each FP8 linear has three cast sites (its input, its weight, its output gradient) and three
buffers: ``fp8_amax_history [history_len, 3]`` (row 0: this step's amax so far, the max over its
micro-batches; rows 1..: the steps before), ``fp8_scale [3]`` and its reciprocals
``fp8_scale_inv_{input,weight,grad}``, what ``_scaled_mm`` takes: a scalar each (inductor's
``_scaled_mm`` refuses a scale that is a view at an offset of a larger buffer). Every cast records
its tensor's amax as it casts; a weight's cast (:func:`weight_to_fp8_at`) is one pass on a GPU
that also writes the transposed copy the input-gradient GEMM reads and the amax, where it was
three (the cast, the cast again in the backward, a multi-tensor amax of all weights in the update:
measured on one H100, 2.4 ms of the 2.7B GPT's 228 ms step for the amax alone). After every step
(:meth:`DelayedScaling.update`) row 0 is max-reduced over the ranks that hold the same layers
(data, context and tensor parallel: afterwards every rank has the amax of the whole tensor over
the whole batch, whatever the layout), the scale becomes ``fmax / amax / 2^margin`` with
``amax`` the newest row (``--fp8-amax-compute-algo most_recent``) or the history's max (``max``),
and the history shifts by one row.

The first step has no history: it casts with current scaling (each tensor's own amax, as
``tensorwise``), which records the amaxes the second step starts from (Transformer Engine starts
from scale 1 instead, where most gradients underflow). A compiled model compiles that step once
more. The buffers are not in the model's state dict: checkpoints carry the histories and scales
next to it (:meth:`DelayedScaling.state`, :meth:`DelayedScaling.loaded`; ``mega.core.checkpoint
.state``), so a resumed run casts as the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from mega.parallel import comm
from mega.parallel.fp8.scaling import (
    AMAX_FLOOR,
    E4M3,
    GRAD_DTYPES,
    amax_of,
    cast_with_scale,
    to_fp8,
)
from mega.parallel.fp8.weight_cast import weight_to_fp8

INPUT, WEIGHT, GRAD = 0, 1, 2  # a linear's cast sites, the columns of its buffers
SITE_NAMES = ("input", "weight", "grad")
SITES = len(SITE_NAMES)


class Sites(NamedTuple):
    """One linear's delayed-scaling state as its casts use it."""

    history: torch.Tensor  # [history_len, 3] float32
    scale: torch.Tensor  # [3] float32
    inverse: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # float32 scalars, 1 / scale
    seeded: bool  # the history has a step in it: cast with ``scale`` (else current scaling)


def sites_of(module: nn.Module) -> Sites | None:
    """The delayed-scaling state of an FP8 linear, or None (current scaling, or not FP8)."""
    history = getattr(module, "fp8_amax_history", None)
    if history is None:
        return None
    inverse = tuple(getattr(module, f"fp8_scale_inv_{name}") for name in SITE_NAMES)
    return Sites(history, module.fp8_scale, inverse, module.fp8_seeded)


def record_amax(sites: Sites, site: int, amax: torch.Tensor) -> None:
    """Fold ``amax`` (a float32 scalar) into the step's row of the history."""
    current = sites.history[0, site]
    current.copy_(torch.maximum(current, amax.float()))


def to_fp8_at(
    tensor: torch.Tensor,
    dtype: torch.dtype,
    sites: Sites | None,
    site: int,
    record: bool,
    columns_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` in ``dtype`` and its inverse scale, by the linear's recipe: current scaling
    (``sites`` None, or a seeding step), or ``site``'s delayed scale. The amax is recorded when
    ``record`` (training)."""
    if sites is None or not sites.seeded:
        data, inverse = to_fp8(tensor, dtype, columns_first)
    else:
        data, inverse = cast_with_scale(tensor, sites.scale[site], dtype), sites.inverse[site]
    if sites is not None and record:
        # an input's rows are the tokens a norm (or the attention) just produced
        rows_first = site == INPUT
        record_amax(sites, site, amax_of(tensor, columns_first, rows_first))
    return data, inverse


def weight_to_fp8_at(
    weight: torch.Tensor, sites: Sites | None, record: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear's ``[out, in]`` weight in E4M3: (row-major, what the forward GEMM reads; the same
    values column-major or row-major, what the input-gradient GEMM is given (it makes them
    column-major if they are not); the inverse scale). With a delayed scale it is one pass that
    writes both and records the amax (when ``record``); else :func:`to_fp8_at`."""
    if sites is None or not sites.seeded:
        data, inverse = to_fp8_at(weight, E4M3, sites, WEIGHT, record)
        return data, data, inverse
    data, data_t, partial_amax = weight_to_fp8(weight, sites.scale[WEIGHT])
    if record:
        record_amax(sites, WEIGHT, partial_amax.amax())
    return data, data_t.t(), sites.inverse[WEIGHT]


def attach(model: nn.Module, history_len: int, device: torch.device) -> list[nn.Module]:
    """Give every FP8 linear of ``model`` (a weight with ``fp8_format``) its buffers, in float32
    on ``device`` (after the model's dtype cast, which would round them to bf16)."""
    linears = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "fp8_format", None) is None or hasattr(module, "fp8_amax_history"):
            continue
        history = torch.zeros(history_len, SITES, dtype=torch.float32, device=device)
        module.register_buffer("fp8_amax_history", history, persistent=False)
        module.register_buffer("fp8_scale", torch.ones(SITES, device=device), persistent=False)
        for name in SITE_NAMES:
            inverse = torch.ones((), device=device)
            module.register_buffer(f"fp8_scale_inv_{name}", inverse, persistent=False)
        module.fp8_seeded = False
        linears.append(module)
    return linears


class DelayedScaling:
    """The delayed-scaling state of one rank's model: updated after every training step."""

    def __init__(
        self,
        model: nn.Module,
        *,
        history_len: int,
        compute_algo: str,
        margin: float,
        groups: list[Any],
        device: torch.device,
    ) -> None:
        names = {module: path for path, module in model.named_modules()}
        self.linears = attach(model, history_len, device)
        self.paths = {names[m]: m for m in self.linears}  # the checkpoint's names
        self.compute_algo, self.margin, self.groups = compute_algo, margin, groups
        # the largest value of each site's format: E4M3 for inputs and weights, the gradient's
        formats = [(E4M3, E4M3, GRAD_DTYPES[m.weight.fp8_format]) for m in self.linears]
        self.fmax = torch.tensor(
            [[torch.finfo(d).max for d in f] for f in formats], dtype=torch.float32, device=device
        )
        self._inverses = [
            m.get_buffer(f"fp8_scale_inv_{n}") for m in self.linears for n in SITE_NAMES
        ]

    def update(self) -> None:
        """The step is over: reduce its amaxes over the ranks, set the scales, shift the
        histories (a handful of kernels and one small all-reduce per group, for all linears)."""
        if not self.linears:
            return
        histories = torch.stack([m.fp8_amax_history for m in self.linears])  # [n, H, 3]
        newest = histories[:, 0].contiguous()
        for group in self.groups:
            comm.all_reduce(newest, group, comm.MAX)
        histories[:, 0] = newest
        amax = newest if self.compute_algo == "most_recent" else histories.amax(dim=1)
        scales = torch.stack([m.fp8_scale for m in self.linears])
        # as scale_for: torch divides a number by a tensor as its reciprocal times the number
        fresh = self.fmax * amax.clamp(min=AMAX_FLOOR).reciprocal()
        if self.margin:
            fresh = fresh / 2.0**self.margin
        # a site that saw nothing yet (or an inf/nan amax) keeps its scale
        scales = torch.where(torch.isfinite(amax) & (amax > 0), fresh, scales)
        shifted = torch.roll(histories, 1, dims=1)
        shifted[:, 0] = 0.0
        torch._foreach_copy_([m.fp8_amax_history for m in self.linears], list(shifted.unbind(0)))
        torch._foreach_copy_([m.fp8_scale for m in self.linears], list(scales.unbind(0)))
        self._set_inverses(scales)
        for m in self.linears:
            m.fp8_seeded = True

    def state(self) -> dict[str, torch.Tensor]:
        """``{"<module path>.amax_history": ..., "<module path>.scale": ...}`` (this rank's
        linears; equal on every rank that holds them, after :meth:`update`)."""
        out = {}
        for path, m in self.paths.items():
            out[f"{path}.amax_history"] = m.fp8_amax_history
            out[f"{path}.scale"] = m.fp8_scale
        return out

    def loaded(self) -> None:
        """The buffers were read from a checkpoint: linears with a history cast delayed."""
        if not self.linears:
            return
        seeded = [bool(m.fp8_amax_history.abs().amax() > 0) for m in self.linears]
        self._set_inverses(torch.stack([m.fp8_scale for m in self.linears]))
        for m, s in zip(self.linears, seeded, strict=True):
            m.fp8_seeded = s

    def _set_inverses(self, scales: torch.Tensor) -> None:
        """Every linear's ``fp8_scale_inv_*`` from ``scales [linears, 3]``."""
        torch._foreach_copy_(self._inverses, list(scales.reciprocal().flatten().unbind(0)))
