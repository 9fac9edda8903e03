"""The routers' statistics over a logging interval, reduced over every rank (one sync).

Each MoE layer's router sums, on the device, what it saw in training forwards since the last
line (``router.stats``: the load-balancing and z losses without their coefficients, tokens per
expert, dropped and routed slots, the forwards). Here they become the line's numbers, as
Megatron prints them: each loss averaged over the MoE layers (of every pipeline stage), the
forwards and the data-parallel ranks. Under sequence or context parallelism a rank's
load-balancing loss is its share of the micro-batch's (the shares add up), its z-loss a mean
over its tokens (the means are averaged).
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.topology import Topology


def _routers(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "stats") and hasattr(m, "num_experts")]


def router_metrics(model: torch.nn.Module, topology: Topology) -> dict[str, Any]:
    """``load_balancing_loss``, ``z_loss`` (when on), ``dropped_token_fraction`` and
    ``expert_load`` (each expert's share of the routed slots, all layers) since the last call;
    empty for a model without routers. Collective over all ranks of a model with routers."""
    routers = _routers(model)
    if not routers:
        return {}
    experts = routers[0].num_experts
    device = routers[0].weight.device
    # [layers, calls, lb, z, has lb, has z, dropped, routed, tokens per expert...]
    totals = torch.zeros(8 + experts, dtype=torch.float64, device=device)
    for router in routers:
        sums = router.stats.take()
        if "calls" not in sums:  # a router that never ran here (its sums made at the first add)
            continue
        calls = sums["calls"].double()
        ran = (calls > 0).double()  # 0 for a router with no training forward since the last line
        totals[0] += ran
        totals[1] += calls
        for slot, name in ((2, "load_balancing_loss"), (3, "z_loss")):
            if name in sums:  # the loss is on for this router
                totals[slot] += sums[name].double()
                totals[slot + 2] += ran
        if "dropped" in sums:
            totals[6] += sums["dropped"].double()
            totals[7] += sums["routed"].double()
            totals[8:] += sums["tokens_per_expert"].double()
    if topology.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(totals)  # every rank: the layers of every stage, every replica
    totals = totals.cpu()
    # the ranks whose load-balancing losses are shares of one micro-batch's (experts need SP
    # under TP, so the TP ranks' are; the CP ranks' always are)
    shares = topology.tensor_model_parallel_size * topology.context_parallel_size
    calls_per_layer = float(totals[1] / totals[0]) if totals[0] else 0.0
    out: dict[str, Any] = {}
    if totals[4] and calls_per_layer:  # summed over TP shares, averaged over the rest
        out["load_balancing_loss"] = float(totals[2] * shares / (totals[4] * calls_per_layer))
    if totals[5] and calls_per_layer:
        out["z_loss"] = float(totals[3] / (totals[5] * calls_per_layer))
    if totals[7]:
        out["dropped_token_fraction"] = float(totals[6] / totals[7])
        load = totals[8:] / totals[8:].sum().clamp(min=1)
        out["expert_load"] = [round(float(x), 6) for x in load]
    return out
