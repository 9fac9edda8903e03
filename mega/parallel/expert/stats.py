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


_LOSSES = ("load_balancing_loss", "z_loss")


def router_metrics(model: torch.nn.Module, topology: Topology) -> dict[str, Any]:
    """``load_balancing_loss``, ``z_loss`` (when on), ``dropped_token_fraction`` and
    ``expert_load`` (each expert's share of the routed slots, all layers) since the last call;
    empty for a model without routers. Collective over all ranks of a model with routers."""
    routers = _routers(model)
    if not routers:
        return {}
    totals = _rank_totals([r.stats for r in routers], routers[0].num_experts)
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


def _rank_totals(stats: list[Any], experts: int) -> torch.Tensor:
    """This rank's ``[layers, calls, lb, z, layers with lb, layers with z, dropped, routed,
    tokens per expert...]`` (float64) from its routers' sums, which are then zeroed. A layer
    counts where its router ran a training forward since the last line; a router that never ran
    here (on meta its sums appear at the first add) adds nothing. A handful of kernels for every
    router together: at one line a step, a loop of a dozen ops per router (the MoE of issue 46:
    ~400 eager launches after the line's sync, the GPU idle ~10 ms a step) was the step's
    largest host cost outside the layers."""
    ran = [s for s in stats if "calls" in s.sums]  # with it, every sum the forward records
    device = stats[0].device
    if ran:
        columns, missing = [], None
        for s in ran:  # calls, lb, z, dropped, routed, tokens per expert: 5 + experts a router
            sums = s.sums
            losses = [sums.get(n) for n in _LOSSES]
            if None in losses and missing is None:  # a loss this router does not compute
                missing = torch.zeros((), device=device)
            losses = [missing if t is None else t for t in losses]
            columns += [t.reshape(1) for t in (sums["calls"], *losses, sums["dropped"])]
            columns += [sums["routed"].reshape(1), sums["tokens_per_expert"]]
        table = torch.cat(columns).view(len(ran), 5 + experts).double()
        layer = (table[:, 0] > 0).double()  # 0 for a router with no training forward since
        with_loss = [[n in s.sums for s in ran] for n in _LOSSES]
        layers_with = [_masked_sum(layer, mask) for mask in with_loss]
        totals = torch.cat(
            [layer.sum().reshape(1), table[:, :3].sum(0), *layers_with, table[:, 3:].sum(0)]
        )
    else:
        totals = torch.zeros(8 + experts, dtype=torch.float64, device=device)
    everything = [t for s in stats for t in s.sums.values()]
    if device.type == "meta":
        for s in stats:
            s.reset()
    elif everything:
        torch._foreach_zero_(everything)
    return totals


def _masked_sum(values: torch.Tensor, mask: list[bool]) -> torch.Tensor:
    """``values``' sum over the positions ``mask`` keeps, as ``[1]`` (no host-to-device copy
    where it keeps all or none, the usual case: every router has the same losses)."""
    if all(mask):
        return values.sum().reshape(1)
    if not any(mask):
        return values.new_zeros(1)
    keep = torch.tensor([i for i, m in enumerate(mask) if m], device=values.device)
    return values.index_select(0, keep).sum().reshape(1)
