"""The planner runs a GPU's grouped GEMM on every row a dispatcher hands it, as the GPU does, and
counts its FLOPs for the rows the groups fill (``mega.parallel.expert.filled_rows``).

At ``n`` expert-parallel ranks the allgather dispatcher hands the experts all ``n * T * k``
gathered slots, of which a balanced routing fills ``T * k``; the GPU's grouped GEMM computes
the filled rows and its outputs (the fc1 output and the SwiGLU's, kept for backward) have room
for all. Planned on the filled rows alone, an EP4 rank of issue 46's MoE was 24.9 GiB against
33.0 measured (one H200, 2026-12-02)."""

from __future__ import annotations

import pytest
import torch

from mega.core.plan.tracking import StepTracker
from mega.parallel.expert.filled_rows import grouped_offsets, mark_filled, share_of
from mega.parallel.expert.local import experts_on_prefix
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.moe import GroupedExperts

H, FFN, EXPERTS, FILLED, RANKS = 64, 96, 2, 128, 4


def _experts(grouped: bool) -> GroupedExperts:
    cfg = GPTConfig(
        hidden_size=H, num_experts=EXPERTS, moe_ffn_hidden_size=FFN, swiglu=True,
        moe_grouped_gemm=grouped,
    )  # fmt: skip
    with torch.device("meta"):
        return GroupedExperts(cfg).to(torch.bfloat16)


def _planned(grouped: bool, rows: int) -> tuple[StepTracker, int]:
    """One forward and backward of the experts over ``rows`` rows, ``FILLED`` of them in
    groups: the tracker, and the bytes live at the forward's end beyond its input and output."""
    experts = _experts(grouped)
    x = torch.empty(rows, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.empty(EXPERTS, device="meta", dtype=torch.int64)
    tracker = StepTracker()
    with tracker:
        start = tracker.live
        y = experts_on_prefix(x, counts, experts, FILLED)
        kept = tracker.live - start - y.numel() * y.element_size()
        y.backward(torch.empty_like(y))
    return tracker, kept


def test_the_grouped_gemm_is_counted_for_the_filled_rows_forward_and_backward():
    tracker, _ = _planned(grouped=True, rows=RANKS * FILLED)
    forward = 2 * FILLED * H * (2 * FFN) + 2 * FILLED * FFN * H
    # backward: each GEMM's input gradient and weight gradient, each as its forward
    assert tracker.work.matmul_flops == pytest.approx(3 * forward)


def test_the_grouped_gemm_keeps_room_for_every_row_it_is_handed():
    _, kept = _planned(grouped=True, rows=RANKS * FILLED)
    _, kept_filled = _planned(grouped=True, rows=FILLED)
    # the fc1 output [rows, 2F] and the SwiGLU's output [rows, F] in bf16, for every row
    assert kept - kept_filled == (RANKS - 1) * FILLED * (2 * FFN + FFN) * 2


def test_the_expert_loop_keeps_only_the_filled_rows():
    """The loop (and the CPU) reads the groups' sizes on the host and runs those rows alone."""
    tracker, kept = _planned(grouped=False, rows=RANKS * FILLED)
    assert tracker.work.matmul_flops == pytest.approx(3 * (2 * FILLED * H * 3 * FFN))
    _, kept_filled = _planned(grouped=False, rows=FILLED)
    # no fc1 or SwiGLU rows for the others: at most the zero rows its output is padded with
    assert kept - kept_filled <= (RANKS - 1) * FILLED * H * 2


def test_offsets_carry_the_share_of_their_counts():
    counts = mark_filled(torch.empty(EXPERTS, device="meta", dtype=torch.int64), 0.25)
    assert share_of(grouped_offsets(counts)) == 0.25
    assert share_of(grouped_offsets(torch.empty(EXPERTS, device="meta"))) == 1.0
    assert share_of(torch.ones(3)) == 1.0  # off meta nothing is marked


def test_marks_leave_a_traced_graph_whole():
    """The planner compiles a MoE layer on meta to measure what it keeps; a mark written or read
    there broke the layer's graph and planned every MoE step 7% slower (session 62)."""

    def offsets(counts: torch.Tensor) -> torch.Tensor:
        return grouped_offsets(mark_filled(counts, 0.5))

    compiled = torch.compile(offsets, fullgraph=True, backend="eager")
    out = compiled(torch.empty(EXPERTS, device="meta", dtype=torch.int64))
    assert out.shape == (EXPERTS,) and out.dtype == torch.int32
