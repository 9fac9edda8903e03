"""The standard normal CDF that the FP8 GeLU kernels use (``mega.parallel.fp8.normal_tail``): one
polynomial and one exp2 in place of the library erf. Checked here on the CPU against float64's
``ndtr``; the GPU test checks the kernels against ATen's GeLU."""

from __future__ import annotations

import math

import pytest
import torch

from mega.parallel.fp8.normal_tail import TAIL_END, normal_cdf


@pytest.mark.parametrize(
    ("low", "high", "bound"), [(0, 2, 5e-8), (2, 4, 1.5e-7), (4, TAIL_END, 1.5e-6)]
)
def test_the_fit_follows_the_tail(low: float, high: float, bound: float):
    """In float64 (the fit alone, no float32 rounding) the tail Φ(-u) is within its stated
    relative error of float64's ndtr (2e-8, 6e-8 and 7.4e-7 on these stretches, bounds at about
    twice that); a coefficient off in its third digit misses by orders of magnitude."""
    u = torch.linspace(low, high, 20001, dtype=torch.float64)[:-1]  # TAIL_END's tail is 0
    tail = normal_cdf(-u)
    assert ((tail - torch.special.ndtr(-u)) / torch.special.ndtr(-u)).abs().max() < bound


def test_the_cdf_is_exactly_0_and_1_where_float32_erf_is_1_and_symmetric_before():
    x = torch.tensor([TAIL_END, 6.0, 40.0, 1e30, float("inf")])
    assert torch.equal(normal_cdf(x), torch.ones_like(x))
    assert torch.equal(normal_cdf(-x), torch.zeros_like(x))
    assert normal_cdf(torch.tensor(0.0)).item() == 0.5
    u = torch.linspace(0, TAIL_END * 0.999, 1001, dtype=torch.float64)
    torch.testing.assert_close(normal_cdf(u) + normal_cdf(-u), torch.ones_like(u), rtol=0, atol=0)


def test_bf16_gelu_in_float32_is_the_correctly_rounded_one_but_at_rounding_boundaries():
    """Every bf16 input from -TAIL_END to 8: ``x * Φ(x)`` in float32, rounded to bf16, is the
    rounded exact GeLU unless the exact value lies within 1e-5 of a rounding boundary (relative;
    the float32 formula's error is under 3.5e-6, whatever the CPU's float32 exp2 rounds). ATen's
    float32 GeLU is not, away from those boundaries, for some x < 0 (its ``1 + erf(x / √2)``
    cancels) and for no x > 0. Below -TAIL_END both are 0."""
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every = codes.view(torch.bfloat16)
    every = every[every.float().isfinite()]
    below = every[every.float() <= -TAIL_END]
    assert torch.equal((below.float() * normal_cdf(below.float())).bfloat16(), below * 0)
    assert torch.equal(torch.nn.functional.gelu(below.float()).bfloat16(), below * 0)
    x = every[(every.float() > -TAIL_END) & (every.float() < 8)]
    ours = (x.float() * normal_cdf(x.float())).bfloat16()
    exact = x.double() * torch.special.ndtr(x.double())
    rounded = exact.bfloat16()
    # the rounding boundary nearest the exact value: halfway to the bf16 neighbour on its side
    neighbour = torch.where(
        exact > rounded.double(),
        torch.nextafter(rounded, torch.tensor(math.inf, dtype=torch.bfloat16)),
        torch.nextafter(rounded, torch.tensor(-math.inf, dtype=torch.bfloat16)),
    )
    boundary = (rounded.double() + neighbour.double()) / 2
    near_boundary = (exact - boundary).abs() <= 1e-5 * exact.abs()
    wrong = (ours != rounded) & ~near_boundary
    assert not wrong.any(), x[wrong][:5]
    aten_wrong = (torch.nn.functional.gelu(x.float()).bfloat16() != rounded) & ~near_boundary
    assert aten_wrong.any() and (x[aten_wrong] < 0).all()  # 45 inputs, in [-5.53, -3.14]
