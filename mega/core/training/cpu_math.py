"""One single-threaded call of each of MKL's vector-math functions before any multi-threaded one.

On the CPU torch hands contiguous float32 and float64 unary ops (``sqrt``, ``exp``, ``log``,
``tanh``, ``erf``, ...) to Intel MKL's VML, which picks each function's kernel on its first call.
oneMKL 2024.2, what torch's CPU wheels bundle, picks unsafely: when that first call runs on
several intra-op threads at once, one thread can run a low-accuracy kernel for its whole chunk of
that one call (pytorch/pytorch#188792, fixed from oneMKL 2025.0). Seen here on a loaded 2-core
machine: in about one of twenty sets of three identical 2-thread runs, one run's first optimizer
step took ``sqrt`` of the second moments that way on the second thread's half of the largest
segment (every later recomputation in that process gave the right values), and its losses left
the others' in the seventh digit a few steps later (tests/test_determinism.py). A one-element
call runs on the calling thread alone and settles each pick.
"""

from __future__ import annotations

import torch

# torch functions whose CPU kernels call VML (aten/src/ATen/cpu/vml.h), and neighbours: a call
# that does not reach VML costs a microsecond
_VECTOR_MATH = (
    "abs", "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10",
    "log1p", "log2", "reciprocal", "rsqrt", "sigmoid", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


def warm_up_vector_math() -> None:
    """Call each vector-math function once on one element (one thread), in float32 and float64:
    about a tenth of a millisecond, so a process that builds two engines pays it twice."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in _VECTOR_MATH:
            getattr(torch, name)(x)
