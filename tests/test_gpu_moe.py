"""MoE experts as grouped GEMMs on a CUDA GPU (skipped where there is none): the same outputs
and gradients as the per-expert loop, in bf16."""

from __future__ import annotations

import pytest
import torch

from mega.plugins.models.common.moe import GroupedExperts
from mega.plugins.models.gpt import GPTConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_gemm_experts_equal_the_loop(swiglu):
    torch.manual_seed(0)
    cfg = GPTConfig(
        hidden_size=256, num_attention_heads=4, num_experts=8, moe_ffn_hidden_size=512,
        swiglu=swiglu, add_bias_linear=False, moe_grouped_gemm=True,
    )  # fmt: skip
    experts = GroupedExperts(cfg).cuda()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    experts = experts.to(torch.bfloat16)
    counts = torch.tensor([0, 37, 128, 5, 64, 1, 90, 3], device="cuda")  # an empty expert too
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        experts.grouped_gemm = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = experts(xi, counts)
        y.float().square().sum().backward()
        results.append([y, xi.grad, *(p.grad for p in experts.parameters())])
    for got, want in zip(*results, strict=True):
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 1e-2, error  # bf16 operands: summation order differs
