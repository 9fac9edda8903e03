"""The built-in token dispatchers over the expert-parallel group (Megatron's
``MoEAllGatherTokenDispatcher`` and ``MoEAlltoAllTokenDispatcher``, written anew).

Rank ``r`` of ``n`` holds experts ``r*E/n .. (r+1)*E/n - 1``; each rank routes its own tokens.

- ``allgather``: every rank gathers every rank's tokens and routings, runs those routed to its
  experts, and the weighted partial outputs are summed back to their ranks (reduce-scatter).
  Simple, and the traffic does not depend on the routing: ``n`` times the tokens each way.
- ``alltoall``: each (token, expert) slot travels to the one rank that holds its expert and
  back, grouped by expert: the traffic is the routed tokens only. The per-expert counts are
  exchanged first (one host sync per layer and step, as Megatron's).

Both are differentiable through their collectives; the routing weights never travel in
``alltoall`` (the outputs are weighted where the tokens live). On the meta device (``mega
plan``) the routing is taken as balanced (:func:`mega.parallel.expert.local.balanced_rows`):
every rank sends each expert ``T * k / E`` rows (at most the capacity) and receives as much.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.comm import group_size
from mega.parallel.expert.collectives import exchange_rows, gather_rows, scatter_rows
from mega.parallel.expert.local import (
    balanced_rows,
    inverse_permutation,
    local_mixture,
    run_experts,
    weighted_sum,
)


class AllGatherDispatcher:
    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        n = group_size(self.group)
        everyone = gather_rows(tokens, self.group)
        probs = gather_rows(routing.probs, self.group)
        indices = gather_rows(routing.indices, self.group)  # integers: no gradient flows
        partial = local_mixture(
            everyone, probs, indices, experts, experts.first, experts.count,
            pad_to=routing.pad_to(n), total=n * experts.count,
            capacity=None if routing.capacity is None else n * routing.capacity,
        )  # fmt: skip
        return scatter_rows(partial, self.group)


class AllToAllDispatcher:
    """Runs eager inside a compiled MoE layer (``torch.compiler.disable``): every step of it
    depends on the routing (``nonzero``, ``bincount``, the counts as host integers for the
    all-to-all's splits), so traced it broke the layer's graph at each of them and recompiled
    whenever the counts changed (guards on their values; seen on CPU ranks with
    TORCH_LOGS=recompiles) until dynamo's recompile limit left those frames eager anyway. The
    router before it and the shared expert after it still compile."""

    def __init__(self, group: Any) -> None:
        self.group = group

    @torch.compiler.disable
    def __call__(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        n, local = group_size(self.group), experts.count
        total = n * local
        k = routing.indices.shape[1]
        flat = routing.indices.reshape(-1)
        meta = flat.is_meta  # the planner: balanced routing (mega.parallel.expert.local)
        if meta:
            rows = balanced_rows(flat.numel(), total, routing.capacity)
            slots = flat.new_empty(sum(rows))
        else:
            slots = (flat >= 0).nonzero().squeeze(1)
        order = torch.argsort(flat[slots], stable=True)  # by expert: by destination rank too
        slots = slots[order]
        if meta:
            per_expert = flat.new_empty(total)
        else:
            per_expert = torch.bincount(flat[slots], minlength=total)  # [E] this rank sends
        # every rank's counts for this rank's experts: [source, local expert]
        counts = exchange_rows(per_expert.view(n, local), [1] * n, [1] * n, self.group)
        if meta:  # every rank routes as this one: its experts get the same rows from each
            send = [sum(rows[r * local : (r + 1) * local]) for r in range(n)]
            recv_counts = [rows[experts.first : experts.first + local]] * n
        else:
            send = per_expert.view(n, local).sum(1).tolist()
            recv_counts = counts.tolist()
        recv = [sum(row) for row in recv_counts]
        arrived = exchange_rows(tokens.index_select(0, slots // k), send, recv, self.group)
        # arrived rows are grouped by source, then expert: regroup them by expert
        source_major = counts.reshape(-1)
        expert_of = torch.arange(local, device=tokens.device).repeat(n)
        if meta:
            row_expert = torch.repeat_interleave(expert_of, source_major, output_size=sum(recv))
        else:
            row_expert = torch.repeat_interleave(expert_of, source_major)
        by_expert = torch.argsort(row_expert, stable=True)
        outputs = run_experts(
            arrived.index_select(0, by_expert), counts.sum(0), experts, routing.pad_to(n)
        )
        back = inverse_permutation(by_expert)
        returned = exchange_rows(outputs.index_select(0, back), recv, send, self.group)
        return weighted_sum(tokens, routing.probs, slots, slots // k, returned)
