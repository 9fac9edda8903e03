"""The Triton kernel of a delayed-scaled weight cast (``mega.parallel.fp8.weight_cast``): one pass
over the bf16 weight writes its FP8 copy both ways (row-major for the forward GEMM, transposed
for the input-gradient GEMM) and each tile's amax (the weight's amax, for the history), where
the compiled graph made three: the cast in the forward, the cast again and transposed in the
backward, the amax in the update. Only imported with a CUDA build of torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from mega.parallel.fp8.gelu_kernels import _cast, _grid, _tile, _tiling
from mega.parallel.fp8.scaling import E4M3


@triton.jit
def _weight_cast_kernel(
    w_ptr,
    scale_ptr,
    out_ptr,
    out_t_ptr,
    partial_amax_ptr,
    m,
    n,
    FMAX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    WIDE: tl.constexpr,
):
    """One tile: ``clamp(w * scale)`` in FP8 at ``[rows, cols]`` and at ``[cols, rows]`` of the
    transposed output, and the tile's amax (no atomics: nothing to zero first)."""
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), m, n, BM, BN, WIDE)
    w = tl.load(w_ptr + rows[:, None] * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    data = _cast(w, tl.load(scale_ptr), FMAX, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], data, mask=mask)
    tl.store(out_t_ptr + cols[None, :] * m + rows[:, None], data, mask=mask)  # [n, m]
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(partial_amax_ptr + tile, tl.max(tl.abs(w)))


@torch.library.triton_op("mega::weight_to_fp8", mutates_args=())
def weight_to_fp8(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row-major ``[m, n]`` weight in E4M3 with ``scale``: (data, data transposed ``[n, m]``,
    one amax per tile, float32)."""
    m, n = weight.shape
    data = torch.empty((m, n), dtype=E4M3, device=weight.device)
    data_t = torch.empty((n, m), dtype=E4M3, device=weight.device)
    grid = _grid(m, n)
    partial_amax = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=weight.device)
    fmax = torch.finfo(E4M3).max
    wrap_triton(_weight_cast_kernel)[grid](
        weight, scale, data, data_t, partial_amax, m, n, FMAX=fmax, **_tiling(m, n)
    )
    return data, data_t, partial_amax
