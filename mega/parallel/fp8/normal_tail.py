"""The standard normal CDF Φ as the FP8 GeLU kernels compute it (``gelu_kernels``): one
polynomial and one exp2 for every input.

The library erf that GeLU is usually written with evaluates one of two polynomials per element,
choosing its coefficients element by element; in the fused GeLU sites that choosing was a third
of the instructions, and the sites were instruction-bound on an H100 (compiled for sm_90: 49
and 84 SASS instructions per element, forward and backward, against 34 and 68 with this).

For u >= 0 the tail Φ(-u) = erfc(u / √2) / 2 is 2^q(u) with q(u) = -1 + u * p(u), ``TAIL`` the
coefficients of p (degree 10, highest power first): a Chebyshev fit of
(log2(erfc(u / √2) / 2) + 1) / u on [0, TAIL_END]. The fit's relative error in the tail is 2e-8
for u < 2, 6e-8 up to 4 and 7.4e-7 up to TAIL_END; evaluated in float32 it is 5e-7, 1.3e-6 and
3.4e-6 (a float32 q near -20 carries that much): rounded to bf16, ``x * Φ(x)`` is the correctly
rounded GeLU of every bf16 input away from rounding boundaries, which the eager float32
``0.5 * x * (1 + erf(x / √2))`` is not at 45 inputs in [-5.53, -3.14], where the sum cancels
(tests/test_fp8_gelu_tail.py). From TAIL_END float32's erf(u / √2) is 1, so the tail
is 0 there, as in the eager GeLU.
"""

from __future__ import annotations

import torch

TAIL = (
    3.3103153551650166e-09, -1.1726804416412051e-07, 1.8520078128858586e-06,
    -1.7064336134353653e-05, 9.874605166260153e-05, -0.00032928556902334094,
    6.620580097660422e-05, 0.006896667182445526, -0.05242181941866875, -0.4592238664627075,
    -1.1511040925979614,
)  # fmt: skip
TAIL_END = 5.548667  # 3.9235 * √2: float32's erf(u / √2) rounds to 1 from here


def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Φ(x) by the kernels' formula, in ``x``'s dtype (multiply then add: the kernels fuse
    each pair into one rounding)."""
    u = x.abs()
    p = torch.full_like(u, TAIL[0])
    for coefficient in TAIL[1:]:
        p = p * u + coefficient
    tail = torch.where(u < TAIL_END, torch.exp2(p * u - 1), 0.0)
    return torch.where(x > 0, 1 - tail, tail)
