"""The built-in schedule tables: no pipelining, GPipe, 1F1B and interleaved 1F1B, and the last
two with their weight gradients split off (``-zb``, zero-bubble style).

Each builder takes ``(pp, vpp, m)`` and returns a complete table (``actions.Table``): the compute
order of every rank with its sends and receives placed by ``placement.with_p2p``. The registry that
names them, and the checks on their arguments, are in ``registry.py``.
"""

from __future__ import annotations

from mega.parallel.pipeline.actions import (
    Backward,
    Compute,
    Forward,
    Table,
    split_weight_grads,
)
from mega.parallel.pipeline.placement import with_p2p


def sequential(pp: int, vpp: int, m: int) -> Table:
    """Every rank: ``F0 B0 F1 B1 ...``. With one rank this is Megatron's
    ``forward_backward_no_pipelining`` (gradients accumulate over the micro-batches, one
    micro-batch's activations alive at a time)."""
    orders: dict[int, list[Compute]] = {
        rank: [op for mb in range(m) for op in (Forward(mb), Backward(mb))] for rank in range(pp)
    }
    return with_p2p(orders, pp, 1)


def gpipe(pp: int, vpp: int, m: int) -> Table:
    """All forwards (micro-batches in order), then all backwards in the same order."""
    orders: dict[int, list[Compute]] = {
        rank: [*(Forward(mb) for mb in range(m)), *(Backward(mb) for mb in range(m))]
        for rank in range(pp)
    }
    return with_p2p(orders, pp, 1)


def one_f_one_b(pp: int, vpp: int, m: int) -> Table:
    """Megatron's non-interleaved 1F1B: rank ``r`` runs ``W = min(pp - r - 1, m)`` warmup
    forwards, then ``m - W`` steps of (forward of the next micro-batch, backward of the oldest
    outstanding one), then the ``W`` remaining backwards. At most ``W + 1`` activations are alive."""
    orders: dict[int, list[Compute]] = {}
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        order: list[Compute] = [Forward(mb) for mb in range(warmup)]
        for step in range(m - warmup):
            order += [Forward(warmup + step), Backward(step)]
        order += [Backward(mb) for mb in range(m - warmup, m)]
        orders[rank] = order
    return with_p2p(orders, pp, 1)


def microbatch_groups(pp: int, m: int) -> list[int]:
    """Sizes of the micro-batch groups of the interleaved schedule: ``max(1, m // pp)`` groups as
    equal as possible, larger ones first. When ``m`` is a multiple of ``pp`` every group has ``pp``
    micro-batches (Megatron's default ``microbatch_group_size_per_vp_stage``). Otherwise no group
    is smaller than ``pp`` (Megatron's partial last group is what deadlocks, its "dependency
    bubbles" error), so chunk ``c + 1`` of a micro-batch is never needed before chunk ``c`` can have
    gone through all ``pp`` ranks. With ``m < pp`` there is one group of ``m``."""
    count = max(1, m // pp)
    base, extra = divmod(m, count)
    return [base + 1] * extra + [base] * (count - extra)


def interleaved_order(pp: int, vpp: int, m: int) -> list[tuple[int, int]]:
    """The forward order of ``(micro-batch, chunk)`` pairs, the same on every rank (Megatron's
    ``get_schedule_table``): each group of ``microbatch_groups`` goes through chunk 0, then chunk 1,
    and so on, before the next group starts."""
    order: list[tuple[int, int]] = []
    start = 0
    for size in microbatch_groups(pp, m):
        order += [(mb, chunk) for chunk in range(vpp) for mb in range(start, start + size)]
        start += size
    return order


def interleaved(pp: int, vpp: int, m: int) -> Table:
    """Megatron's interleaved 1F1B, for any ``pp >= 2`` and ``m >= 1``. Rank ``r`` runs
    ``W = min(2 (pp - r - 1) + (vpp - 1) G, m vpp)`` warmup forwards in ``interleaved_order``
    (``G`` is the first group's size, ``pp`` when ``m`` is a multiple of ``pp``), then steps of
    (next forward, next backward), then the remaining backwards. The backward order is the forward
    order with chunks mirrored (``vpp - 1 - c``): the last chunk's backward comes first.

    When ``m`` is a multiple of ``pp`` this is exactly Megatron's table. With the larger groups
    of ``microbatch_groups`` it also runs for the other ``m`` (Megatron refuses them), and the
    simulated bubble is still ``(pp - 1) / (vpp m + pp - 1)`` for every ``m >= pp``. With
    ``vpp == 1`` this is ``one_f_one_b`` (same bubble, fewer activations kept).

    Transfers are batched as Megatron's: one batch between the computes of the warmup and of the
    cooldown, one per steady (forward, backward) pair (``send_forward_backward_recv_forward_
    backward``). That runs with rendezvous (NCCL) transfers exactly when ``m`` is a multiple of
    ``pp``; for the other ``m``, ``with_p2p`` moves the sends that would deadlock."""
    if vpp == 1:
        return one_f_one_b(pp, vpp, m)
    order = interleaved_order(pp, vpp, m)
    forwards = [Forward(mb, chunk) for mb, chunk in order]
    backwards = [Backward(mb, vpp - 1 - chunk) for mb, chunk in order]
    first_group = microbatch_groups(pp, m)[0]
    total = m * vpp
    orders: dict[int, list[Compute]] = {}
    steps: dict[int, list[int]] = {}
    for rank in range(pp):
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * first_group, total)
        steady = total - warmup
        rank_order: list[Compute] = list(forwards[:warmup])
        for step in range(steady):
            rank_order += [forwards[warmup + step], backwards[step]]
        rank_order += backwards[steady:]
        orders[rank] = rank_order
        # a steady (forward, backward) pair runs back to back: one batch of transfers per pair
        steps[rank] = [1] * warmup + [2] * steady + [1] * warmup
    return with_p2p(orders, pp, vpp, steps)


def one_f_one_b_zero_bubble(pp: int, vpp: int, m: int) -> Table:
    """``one_f_one_b`` with each backward's weight gradients split off (``split_weight_grads``):
    the input gradient goes to the previous stage a weight-gradient GEMM earlier."""
    return split_weight_grads(one_f_one_b(pp, vpp, m))


def interleaved_zero_bubble(pp: int, vpp: int, m: int) -> Table:
    """``interleaved`` with each backward's weight gradients split off (``split_weight_grads``)."""
    return split_weight_grads(interleaved(pp, vpp, m))
