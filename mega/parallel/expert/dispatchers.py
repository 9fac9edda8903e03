"""The built-in token dispatchers over the expert-parallel group (Megatron's
``MoEAllGatherTokenDispatcher`` and ``MoEAlltoAllTokenDispatcher``, written anew).

Rank ``r`` of ``n`` holds experts ``r*E/n .. (r+1)*E/n - 1``; each rank routes its own tokens.

- ``allgather``: every rank gathers every rank's tokens and routings, runs those routed to its
  experts, and the weighted partial outputs are summed back to their ranks (reduce-scatter).
  Simple, and the traffic does not depend on the routing: ``n`` times the tokens each way.
- ``alltoall``: each (token, expert) slot travels to the one rank that holds its expert and
  back, grouped by expert: the traffic is the routed tokens only. The per-expert counts are
  exchanged first (one host sync per layer and step, as Megatron's), except under
  ``--moe-pad-expert-input-to-capacity``, where every split is ``capacity`` rows per expert and
  nothing waits for the GPU.

Both are differentiable through their collectives; the routing weights never travel in
``alltoall`` (the outputs are weighted where the tokens live). On the meta device (``mega
plan``) the routing is taken as balanced (:func:`mega.parallel.expert.local.balanced_rows`):
every rank sends each expert ``T * k / E`` rows (at most the capacity) and receives as much;
padded to capacity, every routing has the same shapes and nothing needs assuming.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.comm import group_size
from mega.parallel.expert.collectives import exchange_rows, gather_rows, scatter_rows
from mega.parallel.expert.local import (
    balanced_rows,
    group_by_expert,
    inverse_permutation,
    local_mixture,
    mix_slots,
    run_experts,
    to_experts,
    to_slots,
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
    """Counted, it runs eager inside a compiled MoE layer (``torch.compiler.disable``): the
    all-to-all's splits are host integers that depend on the routing, so traced it broke the
    layer's graph and recompiled whenever the counts changed (guards on their values; seen on
    CPU ranks with TORCH_LOGS=recompiles) until dynamo's recompile limit left those frames eager
    anyway. The router before it and the shared expert after it still compile.

    One host sync per layer and micro-batch (none when padded to capacity: ``_padded``): the
    slots are sorted by expert (dropped ones, -1, first), each expert's count is found by a
    search in the sorted ids, and the counts this rank sends, the counts it receives and the
    dropped slots come to the host together, once. Tokens reach their slots and the returned
    rows their tokens by gathers both ways (no atomic scatter-add, no ``nonzero``/``bincount``,
    which wait for the GPU)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        if routing.pad and routing.capacity is not None:  # fixed shapes: traced with the layer
            return self._padded(tokens, routing, experts)
        return self._counted(tokens, routing, experts)

    @torch.compiler.disable
    def _counted(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        n, local = group_size(self.group), experts.count
        total = n * local
        t, k = routing.indices.shape
        flat = routing.indices.reshape(-1)
        order, inverse, bounds = group_by_expert(flat, total)  # by expert: by destination too
        per_expert = torch.cat([bounds[:1], bounds.diff()])  # [1 + E]: dropped, then sent
        # every rank's counts for this rank's experts: [source, local expert]
        counts = exchange_rows(per_expert[1:].view(n, local), [1] * n, [1] * n, self.group)
        if flat.is_meta:  # the planner: balanced routing (mega.parallel.expert.local)
            rows = balanced_rows(flat.numel(), total, routing.capacity)
            dropped, sent = flat.numel() - sum(rows), rows
            recv_counts = [rows[experts.first : experts.first + local]] * n
        else:
            host = torch.cat([per_expert, counts.reshape(-1)]).tolist()  # the one sync
            dropped, sent = host[0], host[1 : 1 + total]
            recv_counts = [
                host[1 + total + r * local : 1 + total + (r + 1) * local] for r in range(n)
            ]
        send = [sum(sent[r * local : (r + 1) * local]) for r in range(n)]
        recv = [sum(row) for row in recv_counts]
        outgoing = to_experts(tokens, order, inverse, k)[dropped:]
        arrived = exchange_rows(outgoing, send, recv, self.group)
        # arrived rows are grouped by source, then expert: regroup them by expert
        expert_of = torch.arange(local, device=tokens.device).repeat(n)
        row_expert = torch.repeat_interleave(expert_of, counts.reshape(-1), output_size=sum(recv))
        by_expert = torch.argsort(row_expert, stable=True)
        outputs = run_experts(
            arrived.index_select(0, by_expert), counts.sum(0), experts, routing.pad_to(n)
        )
        back = inverse_permutation(by_expert)
        returned = exchange_rows(outputs.index_select(0, back), recv, send, self.group)
        if dropped:  # a dropped slot adds nothing to its token
            returned = torch.cat([returned.new_zeros(dropped, returned.shape[1]), returned])
        return mix_slots(
            to_slots(returned, order, inverse).view(t, k, -1), routing.probs, tokens.dtype
        )

    def _padded(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        """``--moe-pad-expert-input-to-capacity`` (Megatron's drop-and-pad): each expert gets
        exactly ``capacity`` rows from every rank, so every split is known before the routing
        and nothing waits for the GPU; with no shape that depends on the routing it compiles
        into the MoE layer's graph. Rank ``r`` sends each expert a block of ``capacity``
        rows (its kept slots for that expert in token order, then zero rows); the blocks of
        rank ``r``'s experts go to it in one all-to-all of equal splits, run as one padded
        batch per expert, and come back the same way into the same places."""
        n, local, capacity = group_size(self.group), experts.count, routing.capacity
        total, (t, k), h = n * local, routing.indices.shape, tokens.shape[-1]
        slots = t * k
        flat = routing.indices.reshape(-1)
        order, inverse, bounds = group_by_expert(flat, total)  # dropped (-1) first
        expert = flat.index_select(0, order)  # each sorted slot's expert, -1 if dropped
        sorted_at = torch.arange(slots, device=flat.device)
        within = sorted_at - bounds.index_select(0, expert.clamp(min=0))
        # the capacity drop keeps at most ``capacity`` slots per expert: checked on the device
        torch._assert_async(torch.all((expert < 0) | (within < capacity)))
        # the place of each sorted slot in the send buffer: its expert's block, or a row of its
        # own past the blocks for a dropped slot (unique places: index_copy's gradient is exact)
        place = torch.where(expert >= 0, expert * capacity + within, total * capacity + sorted_at)
        rows = to_experts(tokens, order, inverse, k)
        send = rows.new_zeros(total * capacity + slots, h).index_copy(0, place, rows)
        block = local * capacity  # rows from one rank to another, each way
        arrived = exchange_rows(send[: total * capacity], [block] * n, [block] * n, self.group)
        # [source, local expert, capacity] -> [local expert, source, capacity]: each expert's
        # rows from every rank together, as one padded batch
        by_expert = arrived.view(n, local, capacity, h).transpose(0, 1).reshape(-1, h)
        full = torch.full((local,), n * capacity, dtype=torch.long, device=tokens.device)
        out = experts(by_expert, full).view(local, n, capacity, -1).transpose(0, 1)
        returned = exchange_rows(
            out.reshape(-1, out.shape[-1]), [block] * n, [block] * n, self.group
        )
        # every sorted slot's row back from its place; a dropped slot's place is a zero row
        tail = returned.new_zeros(slots, returned.shape[1])
        back = torch.cat([returned, tail]).index_select(0, place)
        return mix_slots(to_slots(back, order, inverse).view(t, k, -1), routing.probs, tokens.dtype)
