"""``router_metrics`` on a GPU's routers (their sums CUDA tensors marked as static addresses):
the router-by-router numbers, every sum zeroed in its own storage. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from test_router_metrics import _fill, _one_by_one, _Router
from torch import nn

from mega.parallel.expert.stats import router_metrics
from mega.parallel.topology import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_gpus_routers_give_the_router_by_router_numbers():
    routers = [_Router(("load_balancing_loss", "z_loss")).cuda() for _ in range(12)]
    g = torch.Generator().manual_seed(3)
    for router in routers:
        _fill(router, 3, g)
    storages = [t.data_ptr() for r in routers for t in r.stats.sums.values()]
    assert all(t.is_cuda for r in routers for t in r.stats.sums.values())
    expected = _one_by_one(routers)
    got = router_metrics(nn.ModuleList(routers), Topology())
    for name in ("load_balancing_loss", "z_loss", "dropped_token_fraction"):
        assert got[name] == pytest.approx(expected[name], rel=1e-6)
    assert got["expert_load"] == pytest.approx(expected["expert_load"], abs=1e-6)
    assert [t.data_ptr() for r in routers for t in r.stats.sums.values()] == storages
    assert all(not t.any() for r in routers for t in r.stats.sums.values())
