"""``router_metrics`` (an iteration line's MoE numbers) takes every router's sums in a handful of
kernels: the same numbers as adding them router by router, and every sum zeroed after."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mega.parallel.expert.stats import router_metrics
from mega.parallel.topology import Topology
from mega.plugins.models.common.moe import RouterStats

EXPERTS = 4


class _Router(nn.Module):
    """What ``router_metrics`` reads of a router: its stats, expert count and weight."""

    def __init__(self, losses: tuple[str, ...]) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.weight = nn.Parameter(torch.zeros(EXPERTS, 2))
        self.stats = RouterStats(EXPERTS, losses)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        # as the model's Router: the sums follow the weight to its device
        super()._apply(fn, recurse)
        self.stats.move_to(self.weight.device)
        return self


def _one_by_one(routers: list[_Router], shares: int = 1) -> dict:
    """The metrics added router by router, in Python floats: the oracle."""
    layers = calls = dropped = routed = 0.0
    loss = {"load_balancing_loss": [0.0, 0.0], "z_loss": [0.0, 0.0]}  # sum, layers with it
    tokens = [0.0] * EXPERTS
    for router in routers:
        sums = {k: v.tolist() for k, v in router.stats.sums.items()}
        ran = float(sums["calls"] > 0)
        layers += ran
        calls += sums["calls"]
        for name in loss:
            if name in sums:
                loss[name][0] += sums[name]
                loss[name][1] += ran
        dropped += sums["dropped"]
        routed += sums["routed"]
        tokens = [a + b for a, b in zip(tokens, sums["tokens_per_expert"], strict=True)]
    per_layer = calls / layers
    out = {
        "load_balancing_loss": loss["load_balancing_loss"][0]
        * shares
        / (loss["load_balancing_loss"][1] * per_layer),
        "z_loss": loss["z_loss"][0] / (loss["z_loss"][1] * per_layer),
        "dropped_token_fraction": dropped / routed,
        "expert_load": [round(t / sum(tokens), 6) for t in tokens],
    }
    return out


def _fill(router: _Router, calls: int, generator: torch.Generator) -> None:
    """``calls`` training forwards' worth of sums, made on the CPU, added on the router's device."""
    stats, device = router.stats, router.weight.device
    for _ in range(calls):
        values = {
            "calls": torch.ones(()),
            "tokens_per_expert": torch.randint(0, 50, (EXPERTS,), generator=generator),
            "dropped": torch.randint(0, 5, (), generator=generator),
            "routed": torch.tensor(200.0),
        }
        for name in stats.names[len(RouterStats.RECORDED) :]:
            values[name] = torch.rand((), generator=generator)
        for name, value in values.items():
            stats.add(name, value.to(device))


def test_the_metrics_are_the_router_by_router_sums_and_every_sum_is_zeroed():
    both = ("load_balancing_loss", "z_loss")
    # mixed: a router without the z-loss, one that ran no training forward since the last line
    routers = [_Router(both), _Router(("load_balancing_loss",)), _Router(both), _Router(both)]
    g = torch.Generator().manual_seed(0)
    for router, calls in zip(routers, (2, 2, 0, 2), strict=True):
        _fill(router, calls, g)
    routers[1].stats.add("z_loss", torch.zeros(()))  # absent: only a router with it adds one
    del routers[1].stats.sums["z_loss"]
    model = nn.ModuleList(routers)
    expected = _one_by_one(routers)
    # a graphed layer (--cuda-graph-impl local) adds into the same memory at every replay
    storages = [t.data_ptr() for r in routers for t in r.stats.sums.values()]
    got = router_metrics(model, Topology())
    assert [t.data_ptr() for r in routers for t in r.stats.sums.values()] == storages
    assert got.keys() == expected.keys()
    for name in ("load_balancing_loss", "z_loss", "dropped_token_fraction"):
        assert got[name] == pytest.approx(expected[name], rel=1e-6)
    assert got["expert_load"] == pytest.approx(expected["expert_load"], abs=1e-6)
    for router in routers:
        assert all(not t.any() for t in router.stats.sums.values())
    assert router_metrics(model, Topology()) == {}  # nothing ran since: no layer, no line


def test_twelve_routers_take_a_handful_of_ops_not_a_dozen_each():
    """At one iteration line a step the loop of ~15 ops per router ran after the line's sync, its
    launches exposed (issue 46's MoE: ~400 of them, the GPU idle ~10 ms a step on one H200).
    Counted: the ops on the routers' device (what follows ``.cpu()`` launches nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mega.parallel.expert.stats import _rank_totals

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Count.ops += func not in (torch.ops.aten.view.default, torch.ops.aten.detach.default)
            return func(*args, **(kwargs or {}))

    routers = [_Router(("load_balancing_loss",)) for _ in range(12)]
    g = torch.Generator().manual_seed(1)
    for router in routers:
        _fill(router, 2, g)
    with Count():
        _rank_totals([r.stats for r in routers], EXPERTS)
    assert Count.ops <= 20, Count.ops
