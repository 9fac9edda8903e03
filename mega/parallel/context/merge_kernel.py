"""The ring's log-sum-exp merge as one Triton kernel: a block's (out, lse) merged into the
accumulators in place, in one pass over each tensor.

The eager merge (:func:`mega.parallel.context.blocks.merge` and the copies back into the
accumulators' views) takes ten kernels, each a full pass over a float32 product of the output,
and each a launch the ring's host makes per step: on 2 H200 at 16k (1.3B GPT, CP2) they were the
largest share of the ~90 ms a step that CP2's "other" kernels cost over DP2's. Here every row
reads its two lse values and two output rows once and writes the merged row and lse once, in
float32 registers, rounding once to the accumulator's dtype (what the eager float32 sum and its
copy into a bf16 view do). Only imported with a CUDA build of torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32
NUM_WARPS = 4
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _merge(
    out_ptr, lse_ptr, part_ptr, part_lse_ptr,
    heads, rows, d,
    o_b, o_h, o_s, o_d,
    l_b, l_h, l_s,
    p_b, p_h, p_s, p_d,
    q_b, q_h, q_s,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_R`` positions of one (batch, head), all ``d`` columns."""
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    row_ok = r < rows
    mask = row_ok[:, None] & (c[None, :] < d)
    # 64-bit offsets where they can pass 2**31 at long sequences: batch and position. A head's
    # stride stays 32-bit: the ring's accumulators are [b, s, h, d] in memory (stride d), its lse
    # one sequence per head (validated on 2 H200 with these offsets)
    r64, c64 = r.to(tl.int64), c.to(tl.int64)
    lse_at = lse_ptr + b.to(tl.int64) * l_b + h * l_h + r64 * l_s
    part_lse_at = part_lse_ptr + b.to(tl.int64) * q_b + h * q_h + r64 * q_s
    lse = tl.load(lse_at, mask=row_ok, other=0.0)
    part_lse = tl.load(part_lse_at, mask=row_ok, other=0.0)
    # the joint lse and each side's share of the joint softmax, as torch computes them
    high = tl.maximum(lse, part_lse)
    low = tl.minimum(lse, part_lse)
    joint = high + tl.log(1.0 + tl.exp2((low - high) * LOG2E))
    keep = tl.exp2((lse - joint) * LOG2E)
    take = tl.exp2((part_lse - joint) * LOG2E)
    out_at = out_ptr + b.to(tl.int64) * o_b + h * o_h + r64[:, None] * o_s + c64[None, :] * o_d
    part_at = part_ptr + b.to(tl.int64) * p_b + h * p_h + r64[:, None] * p_s + c64[None, :] * p_d
    out = tl.load(out_at, mask=mask, other=0.0).to(tl.float32)
    part = tl.load(part_at, mask=mask, other=0.0).to(tl.float32)
    merged = keep[:, None] * out + take[:, None] * part
    tl.store(out_at, merged.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_at, joint, mask=row_ok)


def merge_in_place(
    out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """``(out, lse)`` := their merge with ``(part_out, part_lse)``: ``out``/``part_out``
    ``[b, h, s, d]`` and ``lse``/``part_lse`` float32 ``[b, h, s]``, any strides (views of the
    accumulators), ``out`` in any float dtype."""
    b, heads, rows, d = out.shape
    if part_out.shape != out.shape or not lse.shape == part_lse.shape == (b, heads, rows):
        raise ValueError(f"merge of {tuple(part_out.shape)} into {tuple(out.shape)}")
    grid = (triton.cdiv(rows, BLOCK_ROWS), b * heads)
    _merge[grid](
        out, lse, part_out, part_lse,
        heads, rows, d,
        *out.stride(), *lse.stride(), *part_out.stride(), *part_lse.stride(),
        BLOCK_R=BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(d), num_warps=NUM_WARPS,
    )  # fmt: skip
