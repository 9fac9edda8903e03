"""``mega::swiglu_rows``'s Triton kernels on a GPU: the rows below ``end`` are the CPU op's
arithmetic (float32, one rounding), rows past ``end`` are never read (NaN there changes nothing
below it). Their speed: benchmarks/swiglu_rows.py. Skipped without a CUDA GPU."""

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
