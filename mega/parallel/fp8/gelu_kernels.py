"""Triton kernels for the GeLU between two FP8 linears (``mega.parallel.fp8.gelu_cast``): each
site is one pass that finds the amax and one that casts, both reading the GEMM output they start
from, so nothing in bf16 is written in between.

- forward: ``h = gelu(y + b)``; pass 1 its amax, pass 2 ``h`` in FP8 (FC2's input);
- backward: ``g = dh * gelu'(y + b)``; pass 1 its amax, its column sums (the bias gradient) and
  FC2's input again, transposed (what FC2's weight-gradient GEMM reads); pass 2 ``g`` in FP8 both
  ways (FC1's input- and weight-gradient GEMMs).

Under delayed scaling the scale is known before the site runs: pass 1 casts too (``CAST``) and
is the site's only pass. Each kernel serves both directions (``GRADIENT``). Rounding follows the
eager ops they replace (``y + b`` and ``gelu`` round to the activations' dtype; the cast is
``clamp(x * scale)``; the scale is ``fmax * (1 / max(amax, floor))`` as torch computes
``fmax / amax``). GeLU's gate Φ is ``normal_tail``'s one-polynomial formula, not the library
erf: the scales come out the reference's and the FP8 values too, but for a rare one step away
(mostly at x < -3, where the eager ``1 + erf`` cancels; the GPU test bounds it). Only imported
with a CUDA build of torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from mega.parallel.fp8.normal_tail import TAIL, TAIL_END
from mega.parallel.fp8.scaling import AMAX_FLOOR, E4M3

BLOCK_ROWS = 64
BLOCK_COLS = 64
NUM_WARPS = 4
E4M3_MAX = tl.constexpr(torch.finfo(E4M3).max)  # FC2's input is always E4M3


@triton.jit
def _tile(rows_block, cols_block, m, n, BM: tl.constexpr, BN: tl.constexpr, WIDE: tl.constexpr):
    rows = rows_block * BM + tl.arange(0, BM)
    cols = cols_block * BN + tl.arange(0, BN)
    if WIDE:  # 64-bit offsets only where 32 bits overflow: they cost instructions per element
        rows, cols = rows.to(tl.int64), cols.to(tl.int64)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    return rows, cols, mask


@triton.jit
def _preactivation(y_ptr, bias_ptr, rows, cols, mask, n, HAS_BIAS: tl.constexpr):
    """``y + b`` rounded to ``y``'s dtype (as the eager add), in float32."""
    y = tl.load(y_ptr + rows[:, None] * n + cols[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=cols < n, other=0.0)
        y = (y.to(tl.float32) + b.to(tl.float32)[None, :]).to(y_ptr.dtype.element_ty)
    return y.to(tl.float32)


# as mega.parallel.fp8.normal_tail.normal_cdf, whose docstring says why and how accurate
_TAIL, _TAIL_TERMS, _TAIL_END = tl.constexpr(TAIL), tl.constexpr(len(TAIL)), tl.constexpr(TAIL_END)


@triton.jit
def _cdf(x):
    """Φ(x), the standard normal CDF of float32 ``x`` (GeLU's gate): one polynomial, one exp2."""
    u = tl.abs(x)
    p = _TAIL[0] * u + _TAIL[1]
    for i in tl.static_range(2, _TAIL_TERMS):
        p = p * u + _TAIL[i]
    tail = tl.where(u < _TAIL_END, tl.exp2(p * u - 1.0), 0.0)
    return tl.where(x > 0, 1.0 - tail, tail)


@triton.jit
def _gelu(x, dtype: tl.constexpr):
    """Exact (erf) GeLU of float32 ``x``, rounded to ``dtype`` and back."""
    return (x * _cdf(x)).to(dtype).to(tl.float32)


@triton.jit
def _gelu_grad(dh, x, dtype: tl.constexpr):
    """``dh * gelu'(x)`` = ``dh * (Φ(x) + x φ(x))``, rounded to ``dtype`` and back. The density
    φ(x) is ATen's ``exp(-x²/2) / √(2π)``: ``tl.exp`` keeps subnormal results (the exp2 that
    folds the constant in flushes them), so where x < -13 the gradient's sign is ATen's."""
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return (dh * (_cdf(x) + x * pdf)).to(dtype).to(tl.float32)


@triton.jit
def _scale(amax_ptr, FMAX: tl.constexpr, FLOOR: tl.constexpr):
    # as mega.parallel.fp8.scaling.scale_for: torch divides a number by a tensor as the
    # tensor's reciprocal times the number, two roundings (IEEE each)
    return tl.div_rn(1.0, tl.maximum(tl.load(amax_ptr), FLOOR)) * FMAX


@triton.jit
def _cast(x, scale, FMAX: tl.constexpr, dtype: tl.constexpr):
    return tl.minimum(tl.maximum(x * scale, -FMAX), FMAX).to(dtype)


@triton.jit
def _store_scales(scale, scale_ptr, inverse_ptr):
    """The first program writes the scale and its inverse (``_scaled_mm``'s operand)."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale)
        tl.store(inverse_ptr, tl.div_rn(1.0, scale))


@triton.jit
def _value(grad_ptr, x, rows, cols, mask, n, dtype: tl.constexpr, GRADIENT: tl.constexpr):
    """What a site casts: ``gelu(x)`` (forward) or ``dh * gelu'(x)`` (backward), float32."""
    if GRADIENT:
        dh = tl.load(grad_ptr + rows[:, None] * n + cols[None, :], mask=mask, other=0.0)
        return _gelu_grad(dh.to(tl.float32), x, dtype)
    return _gelu(x, dtype)


@triton.jit
def _store_data(data, out_ptr, out_t_ptr, rows, cols, mask, m, n, GRADIENT: tl.constexpr):
    """The cast values, row-major ``[m, n]``; backward also transposed ``[n, m]``."""
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], data, mask=mask)
    if GRADIENT:
        tl.store(out_t_ptr + cols[None, :] * m + rows[:, None], data, mask=mask)


@triton.jit
def _amax_kernel(
    grad_ptr,
    y_ptr,
    bias_ptr,
    amax_ptr,
    h_scale_ptr,
    h_t_ptr,
    column_sums_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    scale_out_ptr,
    inverse_ptr,
    m,
    n,
    GRADIENT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CAST: tl.constexpr,
    FMAX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Pass 1: the amax of what the site casts. Backward also writes the partial bias-gradient
    sums and FC2's input again (as the forward cast it, with its scale), transposed. ``CAST``
    (a given scale, ``scale_ptr``): the cast as well, as pass 2 writes it."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), m, n, BM, BN, WIDE)
    dtype = y_ptr.dtype.element_ty
    x = _preactivation(y_ptr, bias_ptr, rows, cols, mask, n, HAS_BIAS)
    value = tl.where(mask, _value(grad_ptr, x, rows, cols, mask, n, dtype, GRADIENT), 0.0)
    if GRADIENT:
        h_data = _cast(_gelu(x, dtype), tl.load(h_scale_ptr), E4M3_MAX, h_t_ptr.dtype.element_ty)
        tl.store(h_t_ptr + cols[None, :] * m + rows[:, None], h_data, mask=mask)  # [n, m]
        # one row of partial sums per row of tiles, summed after: deterministic
        sums = tl.sum(value, axis=0)
        tl.store(column_sums_ptr + tl.program_id(0) * n + cols, sums, mask=cols < n)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(value)))
    if CAST:
        scale = tl.load(scale_ptr)
        data = _cast(value, scale, FMAX, out_ptr.dtype.element_ty)
        _store_data(data, out_ptr, out_t_ptr, rows, cols, mask, m, n, GRADIENT)
        _store_scales(scale, scale_out_ptr, inverse_ptr)


@triton.jit
def _cast_kernel(
    grad_ptr,
    y_ptr,
    bias_ptr,
    amax_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    inverse_ptr,
    m,
    n,
    GRADIENT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Pass 2: the cast with pass 1's amax; backward writes it transposed too."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), m, n, BM, BN, WIDE)
    x = _preactivation(y_ptr, bias_ptr, rows, cols, mask, n, HAS_BIAS)
    value = _value(grad_ptr, x, rows, cols, mask, n, y_ptr.dtype.element_ty, GRADIENT)
    scale = _scale(amax_ptr, FMAX, FLOOR)
    data = _cast(value, scale, FMAX, out_ptr.dtype.element_ty)
    _store_data(data, out_ptr, out_t_ptr, rows, cols, mask, m, n, GRADIENT)
    _store_scales(scale, scale_ptr, inverse_ptr)


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_ROWS), triton.cdiv(n, BLOCK_COLS)


def _tiling(m: int, n: int) -> dict:
    """The launch arguments every kernel here takes."""
    return {"BM": BLOCK_ROWS, "BN": BLOCK_COLS, "WIDE": m * n >= 2**31, "num_warps": NUM_WARPS}


def _cast_site(
    grad: torch.Tensor | None, y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
    h_scale: torch.Tensor | None = None, given_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One site; ``grad`` None: forward. Two passes, or one with a ``given_scale``. Returns
    (data, data transposed, scale, inverse scale, bias gradient, FC2's input transposed, amax);
    backward only fills the transposes and the bias gradient."""
    m, n = y.shape
    gradient, cast = grad is not None, given_scale is not None
    # a pointer a kernel does not read or write still has to be passed: ``y``
    grad_arg, bias_arg = grad if gradient else y, y if bias is None else bias
    new = {"device": y.device}
    h_t = torch.empty((n, m), dtype=E4M3, **new) if gradient else y
    column_sums = torch.empty((_grid(m, n)[0], n), dtype=torch.float32, **new) if gradient else y
    amax = torch.zeros((), dtype=torch.float32, **new)
    data = torch.empty((m, n), dtype=dtype, **new)
    data_t = torch.empty((n, m), dtype=dtype, **new) if gradient else data
    scale, inverse = (torch.empty((), dtype=torch.float32, **new) for _ in range(2))
    flags = {"GRADIENT": gradient, "HAS_BIAS": bias is not None, **_tiling(m, n)}
    fmax = torch.finfo(dtype).max
    wrap_triton(_amax_kernel)[_grid(m, n)](
        grad_arg, y, bias_arg, amax, y if h_scale is None else h_scale, h_t, column_sums, data,
        data_t, given_scale if cast else y, scale, inverse, m, n, CAST=cast, FMAX=fmax, **flags,
    )  # fmt: skip
    if not cast:
        wrap_triton(_cast_kernel)[_grid(m, n)](
            grad_arg, y, bias_arg, amax, data, data_t, scale, inverse, m, n,
            FMAX=fmax, FLOOR=AMAX_FLOOR, **flags,
        )  # fmt: skip
    if not gradient:
        return data, scale, inverse, amax
    return data, data_t, inverse, column_sums.sum(0).to(y.dtype), h_t, amax


# triton_op: under torch.compile the launches go into the compiled graph (no Python dispatch per
# call, allocations planned with the rest); the kernels stay as written (nothing fuses into them)
@torch.library.triton_op("mega::gelu_to_fp8", mutates_args=())
def gelu_to_fp8(
    y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gelu(y + bias)`` of a row-major ``[m, n]`` ``y`` in FP8 ``dtype``: (data, scale,
    inverse scale, amax); with the ``scale`` given (delayed scaling) or from the amax."""
    return _cast_site(None, y, bias, dtype, given_scale=scale)


@torch.library.triton_op("mega::gelu_grad_to_fp8", mutates_args=())
def gelu_grad_to_fp8(
    grad: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    h_scale: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad * gelu'(y + bias)`` in FP8 ``dtype`` row-major and transposed (with ``scale`` or
    from the amax), its inverse scale and its column sums (in ``y``'s dtype), ``gelu(y + bias)``
    cast again to E4M3 with ``h_scale``, transposed, and the amax."""
    return _cast_site(grad, y, bias, dtype, h_scale, scale)
