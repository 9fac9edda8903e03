"""On a GPU, the all-to-all dispatcher padded to capacity (``AllToAllDispatcher._padded``,
``--moe-pad-expert-input-to-capacity``) never waits for the device: run under CUDA's sync debug
mode set to "error", which raises at any synchronising call, forward and backward. (The counted
dispatcher syncs once per layer, on its counts: the same check fails on it.) One GPU; the
dispatcher's group of one rank exchanges nothing, its indexing is all there is."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _dispatch(pad: bool) -> None:
    from mega.parallel.expert.dispatchers import AllToAllDispatcher
    from mega.plugins.models.common.moe import Routing

    torch.manual_seed(0)
    t, k, experts_n, h = 64, 2, 4, 16
    capacity = t  # a token routes to an expert at most once: none over capacity, no drop
    indices = torch.stack([torch.randperm(experts_n)[:k] for _ in range(t)]).cuda()
    probs = torch.rand(t, k, device="cuda")
    weights = torch.randn(experts_n, h, h, device="cuda", requires_grad=True)

    def run(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        which = torch.repeat_interleave(
            torch.arange(experts_n, device="cuda"), counts, output_size=x.shape[0]
        )
        return torch.bmm(x.unsqueeze(1), weights.index_select(0, which)).squeeze(1)

    experts = type("Experts", (), {"count": experts_n, "first": 0, "__call__": staticmethod(run)})()
    tokens = torch.randn(t, h, device="cuda", requires_grad=True)
    routing = Routing(probs, indices, capacity, pad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = AllToAllDispatcher(None)(tokens, routing, experts)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_padded_dispatch_does_not_synchronise():
    _dispatch(pad=True)


def test_the_counted_dispatch_does_synchronise():
    with pytest.raises(RuntimeError, match="synchroniz"):
        _dispatch(pad=False)
