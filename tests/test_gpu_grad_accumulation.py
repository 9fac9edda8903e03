"""``accumulate_into``'s Triton kernel on a GPU gives torch's ``copy_``/``add_`` bit for bit (each
element ``float32(main) + float32(grad)`` rounded once), for both low-precision dtypes, at the
size it starts at and at sizes that end inside a block. Its speed: benchmarks/grad_accumulation.py.
Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from mega.parallel.data.accumulate import TRITON_MIN_ELEMENTS, accumulate_into, takes_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("extra", [0, 77, 4095])
def test_the_kernel_gives_torchs_copy_and_add_bit_for_bit(dtype: torch.dtype, extra: int):
    n = TRITON_MIN_ELEMENTS + extra
    gen = torch.Generator(device="cuda").manual_seed(extra)
    grads = [(torch.randn(n, device="cuda", generator=gen) * 3).to(dtype) for _ in range(3)]
    main = torch.full((n,), float("nan"), device="cuda")  # the copy must not read it
    assert takes_triton(main, grads[0])
    expected = grads[0].float()
    accumulate_into(main, grads[0], first=True)
    assert torch.equal(main, expected)
    for grad in grads[1:]:
        expected.add_(grad)
        accumulate_into(main, grad, first=False)
        assert torch.equal(main, expected)


def test_a_view_into_a_flat_buffer_leaves_its_neighbours_alone():
    n = TRITON_MIN_ELEMENTS + 5
    flat = torch.full((n + 128,), -1.0, device="cuda")
    grad = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    accumulate_into(flat[64 : 64 + n], grad, first=True)
    assert torch.equal(flat[:64], torch.full((64,), -1.0, device="cuda"))
    assert torch.equal(flat[64 + n :], torch.full((64,), -1.0, device="cuda"))
    assert torch.equal(flat[64 : 64 + n], torch.ones(n, device="cuda"))
