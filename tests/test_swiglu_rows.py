"""``mega::swiglu_rows`` (the experts' SwiGLU over the rows their grouped GEMM fills) on the CPU:
the arithmetic (float32, one rounding to bf16) and its gradient against autograd's, the fake the
compiler traces with, and one opaque op in a compiled graph. The kernels' rows and their speed
are checked on a GPU (tests/test_gpu_swiglu_rows.py)."""

from __future__ import annotations

import torch

from mega.plugins.models.common.swiglu_rows import swiglu_rows

ROWS, FFN = 24, 40


def _reference(hidden: torch.Tensor) -> torch.Tensor:
    gate, up = hidden.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_the_op_is_silu_of_the_gate_times_up_rounded_once_with_its_gradient():
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(ROWS, 2 * FFN, generator=gen) * 3).bfloat16()
    grad = torch.randn(ROWS, FFN, generator=gen).bfloat16()
    end = torch.tensor([ROWS], dtype=torch.int32)
    leaf = hidden.clone().requires_grad_(True)
    out = swiglu_rows(leaf, end)
    out.backward(grad)
    exact = hidden.float().requires_grad_(True)
    want = _reference(exact)
    want.backward(grad.float())
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, FFN)
    assert torch.equal(out, want.bfloat16())  # one rounding of the float32 result
    assert torch.equal(leaf.grad, exact.grad.bfloat16())


def test_the_fake_gives_the_shapes_and_a_compiled_call_is_one_opaque_op():
    from torch._dynamo.testing import CompileCounterWithBackend

    meta = torch.empty(ROWS, 2 * FFN, device="meta", requires_grad=True)
    out = swiglu_rows(meta, torch.empty(1, dtype=torch.int32, device="meta"))
    assert out.shape == (ROWS, FFN) and out.device.type == "meta"
    out.sum().backward()
    assert meta.grad.shape == meta.shape
    counter = CompileCounterWithBackend("aot_eager")
    hidden = torch.randn(ROWS, 2 * FFN)
    end = torch.tensor([ROWS - 5], dtype=torch.int32)

    def f(h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return swiglu_rows(h * 2, e) * 3

    results = []
    for fn in (f, torch.compile(f, backend=counter, fullgraph=True)):
        leaf = hidden.clone().requires_grad_(True)
        out = fn(leaf, end)
        out.sum().backward()
        results.append((out.detach(), leaf.grad))
    (graph,) = counter.graphs
    assert "swiglu_rows" in graph.code, graph.code
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
