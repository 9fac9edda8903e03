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
- ``flex``: ``alltoall``'s traffic with the counts kept on the device (no host sync, no shape
  that depends on the routing; :mod:`mega.parallel.expert.split_exchange`), dropless only. The
  experts run on a buffer with room for any routing (``n`` times the rows sent, and a row per
  sub-expert: each block travels cut in pieces). Its steps and their order, with and without
  ``--overlap-moe-expert-parallel-comm``, are :mod:`mega.parallel.expert.flex_schedule`'s.

Both are differentiable through their collectives; the routing weights never travel in
``alltoall`` (the outputs are weighted where the tokens live). On the meta device (``mega
plan``) the routing is taken as balanced (:func:`mega.parallel.expert.local.balanced_rows`):
every rank sends each expert ``T * k / E`` rows (at most the capacity) and receives as much;
padded to capacity, every routing has the same shapes and nothing needs assuming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mega.parallel.comm import group_size
from mega.parallel.expert.collectives import exchange_rows, gather_rows, scatter_rows
from mega.parallel.expert.local import (
    balanced_rows,
    blocks_undone,
    group_by_expert,
    grouped_on_gpu,
    local_mixture,
    mix_slots,
    regroup_blocks,
    run_experts,
    to_experts,
    to_slots,
)
from mega.parallel.expert.validate import padded_trips
from mega.parallel.weight_grad import traced


@dataclass
class _Trip:
    """What the all-to-all's way back needs from its way out: the rows sent to and received
    from each rank, the received blocks' sizes by expert (``by_expert``: expert-major, each
    expert's blocks by source) and the block order back to source-major (``back``), and the
    slots the capacity dropped (sorted first, never sent)."""

    send: list[int]
    recv: list[int]
    by_expert: list[int]
    back: list[int]
    dropped: int


def _expert_major(n: int, local: int) -> list[int]:
    """The order of ``n * local`` blocks, source-major (``source * local + expert``), that
    puts them expert-major: each local expert's blocks from every source together."""
    return [source * local + expert for expert in range(local) for source in range(n)]


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
    """One host sync per layer and micro-batch (none when padded to capacity: ``_padded``): the
    slots are sorted by expert (dropped ones, -1, first), each expert's count is found by a
    search in the sorted ids, and the counts this rank sends, the counts it receives and the
    dropped slots come to the host together, once. Tokens reach their slots and the returned
    rows their tokens by gathers both ways (no atomic scatter-add, no ``nonzero``/``bincount``,
    which wait for the GPU). The rows that arrive, by source and then expert, are regrouped by
    expert as blocks whose sizes the synced counts give: one ``cat`` each way (it was an argsort
    of the rows' experts and two gathers).

    Compiled (``--compile``), only the two trips run eager (``_outbound``, ``_inbound``, behind
    ``torch.compiler.disable``): the all-to-all's splits are host integers that depend on the
    routing, and traced they broke the layer's graph and recompiled whenever the counts changed
    (guards on their values; seen on CPU ranks with TORCH_LOGS=recompiles). The sort before the
    outbound trip, the experts between the trips (their rows' count marked *unbacked*: one graph
    for every count) and the mixing after the inbound trip are traced. Before, the whole
    dispatch ran eager, the experts' activation and the float32 mixing included: a fake-world
    EP2 rank of the MoE of issue 46 spent 235 ms a step against a DP2 rank's 179 (one H200,
    2026-11-29)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        if routing.pad and routing.capacity is not None:  # fixed shapes: traced with the layer
            return self._padded(tokens, routing, experts)
        return self._counted(tokens, routing, experts)

    def _counted(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        n, local = group_size(self.group), experts.count
        t, k = routing.indices.shape
        order, inverse, bounds = group_by_expert(routing.indices.reshape(-1), n * local)
        per_expert = torch.cat([bounds[:1], bounds.diff()])  # [1 + E]: dropped, then sent
        # every rank's counts for this rank's experts: [source, local expert]
        counts = exchange_rows(per_expert[1:].view(n, local), [1] * n, [1] * n, self.group)
        outgoing = to_experts(tokens, order, inverse, k)  # by expert: by destination too
        arrived, rows, trip = self._outbound(
            outgoing, per_expert, counts, experts, routing.capacity, traced()
        )
        outputs = run_experts(arrived, rows, experts, routing.pad_to(n))
        returned = self._inbound(outputs, trip)  # [T * k, h] in sorted slot order
        return mix_slots(
            to_slots(returned, order, inverse).view(t, k, -1), routing.probs, tokens.dtype
        )

    @torch.compiler.disable
    def _outbound(
        self,
        outgoing: torch.Tensor,
        per_expert: torch.Tensor,
        counts: torch.Tensor,
        experts: Any,
        capacity: int | None,
        unbacked: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, _Trip]:
        """The sorted slots' rows to their experts' ranks: ``(rows grouped by local expert,
        rows per local expert, what the way back needs)``. ``capacity``: the most rows an
        expert keeps (the planner's balanced routing); ``unbacked``: a traced graph takes the
        rows (their count marked unbacked, :mod:`mega.parallel.expert.traced`)."""
        n, local = group_size(self.group), experts.count
        total = n * local
        if per_expert.is_meta:  # the planner: balanced routing (mega.parallel.expert.local)
            rows = balanced_rows(outgoing.shape[0], total, capacity)
            dropped, sent = outgoing.shape[0] - sum(rows), rows
            recv_counts = [rows[experts.first : experts.first + local]] * n
        else:
            host = torch.cat([per_expert, counts.reshape(-1)]).tolist()  # the one sync
            dropped, sent = host[0], host[1 : 1 + total]
            recv_counts = [
                host[1 + total + r * local : 1 + total + (r + 1) * local] for r in range(n)
            ]
        send = [sum(sent[r * local : (r + 1) * local]) for r in range(n)]
        recv = [sum(row) for row in recv_counts]
        arrived = exchange_rows(outgoing[dropped:], send, recv, self.group)
        # arrived rows are grouped by source, then expert, in blocks whose sizes the host has:
        # regrouped by expert as blocks, one cat each way (no sort, no index tensor)
        blocks = [rows for source in recv_counts for rows in source]
        order = _expert_major(n, local)
        grouped = regroup_blocks(arrived, blocks, order)
        # on meta (the planner) the balanced rows' count is the one to measure the graph with,
        # as local.assign does: unbacked, torch 2.11 could not size the graph and the planner
        # counted the layer as eager (EP2 peak planned +19% against a fake-world rank)
        if unbacked and not grouped.is_meta:
            from mega.parallel.expert.traced import unbacked_rows

            unbacked_rows(grouped)
        by_expert, back = blocks_undone(blocks, order)
        return grouped, counts.sum(0), _Trip(send, recv, by_expert, back, dropped)

    @torch.compiler.disable
    def _inbound(self, outputs: torch.Tensor, trip: _Trip) -> torch.Tensor:
        """The experts' outputs back to the ranks their tokens came from, in the outbound
        rows' order, a zero row first for each dropped slot (it adds nothing to its token)."""
        by_source = regroup_blocks(outputs, trip.by_expert, trip.back)
        returned = exchange_rows(by_source, trip.recv, trip.send, self.group)
        if trip.dropped:
            returned = torch.cat([returned.new_zeros(trip.dropped, returned.shape[1]), returned])
        return returned

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


class DeviceSplitDispatcher:
    """``flex``: the routed rows to their experts' ranks and back by
    :func:`~mega.parallel.expert.split_exchange.dispatch_rows` and ``combine_rows``, whose
    splits never leave the device. The slots are sorted by expert as ``alltoall`` sorts them,
    and each (rank, expert) block is cut into pieces that travel as sub-experts
    (``pieces_per_expert``). The rows arrive expert-major in a buffer of ``n * T * k`` rows and
    each expert's padding (any routing fits; split_exchange's docstring), and the experts'
    grouped GEMM runs on its blocks (its offsets are where the next expert's room begins, so
    an expert's group holds its padding rows, zeroed; the rows past the last offset it does
    not touch).
    ``overlap`` (``--overlap-moe-expert-parallel-comm``): the tokens in two chunks, each one's
    trips beside the other's experts (:mod:`mega.parallel.expert.flex_schedule`)."""

    def __init__(self, group: Any, overlap: bool = False, pipelined: bool | None = None) -> None:
        self.group = group
        # the pipelined schedule where the layer is one graph (None: local.grouped_on_gpu
        # decides; True: always, for its CPU test, eager or traced without inductor)
        self.pipelined = pipelined
        self.name = group.group_name if group is not None else ""  # resolved outside traced code
        self._overlapped: Any = None  # the overlapped schedule, once turned on
        if overlap:
            self.overlap_trips()

    def overlap_trips(self) -> None:
        """From now on the trips overlapped (``--overlap-moe-expert-parallel-comm``): over the
        padded trips with the grouped GEMM on GPUs pipelined on one stream (traced whole),
        otherwise on a side stream. That schedule is marked here for torch.compile to call, not
        trace (streams are not traced), once: a mark made at the first traced call recompiled
        the layer. The layer's compile options (inductor's sink_waits) are asked for either
        way: which schedule runs is known only from the data."""
        from mega.parallel.expert import flex_schedule

        self._overlapped = torch.compiler.disable(flex_schedule.overlapped)
        self.compile_options = flex_schedule.PIPELINED_COMPILE_OPTIONS

    def __call__(self, tokens: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        from mega.parallel.expert import flex_schedule
        from mega.parallel.expert.split_exchange import pieces_per_expert

        n, local = group_size(self.group), experts.count
        pieces = pieces_per_expert(n, local, tokens.device)
        shape = flex_schedule.Shape(self.group, n, local, pieces, self.name)
        # two equal chunks: one shape, so the chunks share NVSHMEM buffers (an odd count of
        # tokens, which no real sequence gives, runs as one chunk rather than make two shapes)
        if self._overlapped is None or tokens.shape[0] % 2 or tokens.shape[0] < 2:
            return flex_schedule.in_order(tokens, routing, experts, shape)
        pipelined = self.pipelined
        if pipelined is None:
            pipelined = grouped_on_gpu(tokens, experts)
        if pipelined and padded_trips(tokens.device) and n > 1:
            return flex_schedule.pipelined(tokens, routing, experts, shape)
        return self._overlapped(tokens, routing, experts, shape)  # compiled: a graph break
