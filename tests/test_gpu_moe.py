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
    experts = _rank_experts(local=8, first=0, hidden=256, ffn=512, swiglu=swiglu)
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


def _rank_experts(
    local: int, first: int, hidden: int, ffn: int, swiglu: bool = True
) -> GroupedExperts:
    """``local`` bf16 experts on the GPU (SwiGLU or GELU), as an expert-parallel rank holding
    experts ``first .. first + local - 1`` has them."""
    cfg = GPTConfig(
        hidden_size=hidden, num_attention_heads=4, num_experts=local, moe_ffn_hidden_size=ffn,
        swiglu=swiglu, add_bias_linear=False, moe_grouped_gemm=True,
    )  # fmt: skip
    experts = GroupedExperts(cfg).cuda()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    experts = experts.to(torch.bfloat16)
    experts.first = first
    return experts


def _mixed(experts, mix, x: torch.Tensor, probs: torch.Tensor) -> list[torch.Tensor]:
    """``mix(x, probs)``'s output and the gradients of ``sum(output^2)``."""
    experts.zero_grad()
    xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    y = mix(xi, pi)
    y.float().square().sum().backward()
    return [y, xi.grad, pi.grad, *(p.grad for p in experts.parameters())]


def _assert_close(results: list[list[torch.Tensor]]) -> None:
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 1e-2, error  # bf16 operands: summation and rounding order differ


def test_an_expert_parallel_rank_mixes_without_a_sync_as_the_loop_does():
    """``held_mixture`` on a GPU: the grouped GEMMs run over every slot's row, the held ones in
    front, and leave what they like past the groups; the outputs and gradients equal the
    per-expert loop over the held rows alone (mega.parallel.expert.local)."""
    from mega.parallel.expert.local import local_mixture

    torch.manual_seed(0)
    experts = _rank_experts(local=2, first=2, hidden=256, ffn=512)  # rank 1 of EP2, 4 experts
    tokens = 512
    probs, indices = torch.topk(torch.softmax(torch.randn(tokens, 4, device="cuda"), -1), 2)
    indices[torch.rand(tokens, 2, device="cuda") < 0.1] = -1  # dropped slots
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        experts.grouped_gemm = grouped
        results.append(
            _mixed(
                experts,
                lambda xi, pi: local_mixture(xi, pi, indices, experts, 2, 2, total=4),
                x,
                probs,
            )
        )
    _assert_close(results)


def test_a_compiled_expert_parallel_rank_mixes_as_eager():
    """``held_mixture`` compiled (one graph, the grouped GEMMs' offsets on the device) against
    eager: outputs and gradients (as a script on one H200, 2026-12-01: within 1.3e-4)."""
    from mega.parallel.expert.local import local_mixture

    torch.manual_seed(0)
    experts = _rank_experts(local=4, first=0, hidden=512, ffn=704)  # rank 0 of EP2, 8 experts
    probs, indices = torch.topk(torch.softmax(torch.randn(2048, 8, device="cuda"), -1), 2)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)

    def mixture(xi: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
        return local_mixture(xi, pi, indices, experts, 0, 4, total=8)

    _assert_close([_mixed(experts, fn, x, probs) for fn in (mixture, torch.compile(mixture))])
