"""``mega::swiglu_rows``'s Triton kernels on a GPU: the rows below ``end`` are the CPU op's
arithmetic (float32, one rounding), rows past ``end`` are never read (NaN there changes nothing
below it) nor written (the output's rows past ``end`` keep what the allocator gave), and the
kernels' time against Inductor's fused activation over every row is printed (no bound: speed is
measured by benchmarks). Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from mega.plugins.models.common.swiglu_rows import swiglu_rows, swiglu_rows_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _reference(hidden: torch.Tensor) -> torch.Tensor:
    gate, up = hidden.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows,ffn,end", [(64, 40, 37), (4096, 2816, 2051), (512, 256, 512)])
def test_the_kernels_take_the_rows_below_end_only(rows: int, ffn: int, end: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(rows, 2 * ffn, device="cuda", generator=gen) * 3).bfloat16()
    grad = torch.randn(rows, ffn, device="cuda", generator=gen).bfloat16()
    hidden[end:] = float("nan")  # a row past end that were read would spread NaN
    grad[end:] = float("nan")
    at = torch.tensor([end], dtype=torch.int32, device="cuda")
    out = swiglu_rows(hidden, at)
    d_hidden = swiglu_rows_backward(grad, hidden, at)
    cpu_out = swiglu_rows(hidden[:end].cpu(), at.cpu())
    cpu_d = swiglu_rows_backward(grad[:end].cpu(), hidden[:end].cpu(), at.cpu())
    torch.testing.assert_close(out[:end].cpu(), cpu_out, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(d_hidden[:end].cpu(), cpu_d, rtol=2**-7, atol=1e-6)


def test_the_kernels_against_inductors_activation_over_every_row():
    rows, ffn = 32768, 2816  # flex's EP2 arrival of issue 46's MoE (micro-batch 4)
    hidden = torch.randn(rows, 2 * ffn, device="cuda").bfloat16().requires_grad_(True)
    grad = torch.randn(rows, ffn, device="cuda").bfloat16()
    half = torch.tensor([rows // 2], dtype=torch.int32, device="cuda")

    def inductor(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    compiled = torch.compile(inductor)

    def timed(step) -> float:  # noqa: ANN001
        for _ in range(3):
            step()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            step()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 20

    def ours() -> None:
        swiglu_rows(hidden, half).backward(grad)

    def theirs() -> None:
        compiled(hidden).backward(grad)

    ours_ms, theirs_ms = timed(ours), timed(theirs)
    print(
        f"swiglu forward+backward: half the rows {ours_ms:.3f} ms, Inductor all {theirs_ms:.3f} ms"
    )
    assert ours_ms > 0 and theirs_ms > 0
