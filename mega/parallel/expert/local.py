"""The tokens routed to the experts one rank holds, through those experts, weighted and summed.

A routing is ``probs [T, k]`` and ``indices [T, k]``: each token's ``k`` experts (global ids;
-1 marks a slot the capacity dropped) and their weights. The rank holds experts
``first .. first + count - 1``. Its slots are grouped by expert (stable: token order inside an
expert), run through the experts as one ``[N, h]`` batch with per-expert counts, weighted by
their probabilities in float32 and added back at their tokens.

On the meta device (``mega plan`` counts a step there) a routing has shapes but no values, so
what depends on them (which slots a rank holds, how many rows each expert gets) is taken as
**balanced**: the ``T * k`` slots spread evenly over the experts (:func:`balanced_rows`), at
most the capacity each. Every op still runs, on those shapes; tensors off meta never take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mega.parallel.expert.filled_rows import mark_filled
from mega.parallel.expert.sort_keys import narrow_ids
from mega.parallel.weight_grad import traced


class Experts(Protocol):
    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [N, h]`` grouped by local expert, ``counts [E_local]`` -> ``[N, h]``."""
        ...


@dataclass
class Assignment:
    """The slots of a routing that go to this rank's experts, grouped by local expert."""

    slots: torch.Tensor  # [N] flat slot (token * k + j) of each row, grouped by expert
    tokens: torch.Tensor  # [N] the token of each row
    counts: torch.Tensor  # [E_local] rows per local expert


def balanced_rows(slots: int, experts: int, capacity: int | None = None) -> list[int]:
    """Rows per expert when ``slots`` (token, expert) slots are routed evenly over ``experts``
    (the first ``slots % experts`` get one more), each at most ``capacity``: the routing the
    planner assumes on the meta device, where the real one has no values."""
    share, extra = divmod(slots, experts)
    rows = [share + (e < extra) for e in range(experts)]
    return rows if capacity is None else [min(r, capacity) for r in rows]


def assign(
    indices: torch.Tensor,
    first: int,
    count: int,
    total: int | None = None,
    capacity: int | None = None,
) -> Assignment:
    """Which slots of ``indices [T, k]`` go to experts ``first .. first + count - 1``. On the
    meta device: balanced over ``total`` experts (default ``count``), at most ``capacity`` rows
    each (module docstring)."""
    k = indices.shape[1]
    flat = indices.reshape(-1)
    if traced() and not indices.is_meta:  # eager; its sizes unbacked for the graph after it
        from mega.parallel.expert.traced import held_slots

        return Assignment(*held_slots(flat, k, first, count))
    local = flat - first
    mine = (flat >= 0) & (local >= 0) & (local < count)
    if indices.is_meta:
        rows = balanced_rows(flat.numel(), total or count, capacity)[first : first + count]
        slots = flat.new_empty(sum(rows))
    else:
        slots = mine.nonzero().squeeze(1)
    local = local[slots]
    order = torch.argsort(narrow_ids(local, count), stable=True)
    slots, local = slots[order], local[order]
    if indices.is_meta:
        return Assignment(slots, slots // k, local.new_empty(count))
    return Assignment(slots, slots // k, torch.bincount(local, minlength=count))


def run_experts(
    x: torch.Tensor, counts: torch.Tensor, experts: Experts, pad_to: int | None = None
) -> torch.Tensor:
    """``experts(x, counts)``; with ``pad_to`` every expert gets exactly that many rows (zero rows
    added, their outputs dropped): --moe-pad-expert-input-to-capacity's fixed shapes."""
    if pad_to is None:
        return experts(x, counts)
    count = counts.numel()
    if counts.is_meta:  # balanced (module docstring): within capacity, x's rows in all
        rows = torch.repeat_interleave(
            torch.arange(count, device=x.device), counts, output_size=x.shape[0]
        )
    else:
        if count and int(counts.max()) > pad_to:
            raise ValueError(
                f"an expert got {int(counts.max())} tokens, over its capacity {pad_to}"
            )
        rows = torch.repeat_interleave(torch.arange(count, device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(x.shape[0], device=x.device) - starts[rows]
    place = rows * pad_to + within
    padded = x.new_zeros(count * pad_to, x.shape[1]).index_copy(0, place, x)
    full = torch.full_like(counts, pad_to)
    return experts(padded, full).index_select(0, place)


def local_mixture(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    indices: torch.Tensor,
    experts: Experts,
    first: int,
    count: int,
    pad_to: int | None = None,
    complete: bool = False,
    total: int | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """``sum_j probs[t, j] * expert_{indices[t, j]}(tokens[t])`` over the slots whose expert is
    held here (``[T, h]``, zero for tokens with none), in ``tokens``' dtype. ``complete``: every
    slot goes to an expert held here (all experts are local and none was dropped), see
    :func:`complete_mixture`; otherwise :func:`held_mixture`, unless padded to capacity
    (``pad_to``: the held slots found on the host, one sync). ``total`` and ``capacity``: the experts in all and the rows each
    keeps of ``indices``, for the balanced routing on the meta device (:func:`assign`)."""
    if complete:
        return complete_mixture(tokens, probs, indices, experts, count, pad_to)
    if pad_to is None:
        return held_mixture(tokens, probs, indices, experts, first, count, total, capacity)
    job = assign(indices, first, count, total, capacity)
    y = run_experts(tokens.index_select(0, job.tokens), job.counts, experts, pad_to)
    return weighted_sum(tokens, probs, job.slots, job.tokens, y)


def weighted_sum(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    slots: torch.Tensor,
    owners: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """``[T, h]`` in ``tokens``' dtype: each of ``rows`` (the expert output of flat slot
    ``slots[i]``, whose token is ``owners[i]``) times its probability, summed per token in
    float32; zero for a token with no row."""
    weights = probs.reshape(-1).index_select(0, slots).float().unsqueeze(1)
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    return out.index_add(0, owners, rows.float() * weights).to(tokens.dtype)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse[order[i]] = i``."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


class _ToExperts(torch.autograd.Function):
    """``rows[r] = tokens[order[r] // k]``: each token's ``k`` slots, in expert order. Backward
    gathers the rows back into slot order and sums each token's ``k`` (float32), where the
    generic gather's backward would scatter-add with atomics; with ``held`` (``[T * k]``) only
    the held slots' rows: the others' gradient rows are whatever the experts' grouped GEMM left
    past its groups (:func:`held_mixture`), never read."""

    @staticmethod
    def forward(
        ctx,
        tokens: torch.Tensor,
        order: torch.Tensor,
        inverse: torch.Tensor,
        k: int,
        held: torch.Tensor | None,
    ):
        ctx.save_for_backward(inverse, held)
        ctx.k = k
        return tokens.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, held = ctx.saved_tensors
        per_slot = grad.index_select(0, inverse).view(-1, ctx.k, grad.shape[-1])
        if held is not None:
            per_slot = torch.where(held.view(-1, ctx.k, 1), per_slot, per_slot.new_zeros(()))
        return per_slot.float().sum(1).to(grad.dtype), None, None, None, None


class _Permute(torch.autograd.Function):
    """``out[i] = rows[perm[i]]`` for a permutation ``perm``: backward is the opposite gather
    (``inverse``), where index_select's would scatter-add with atomics."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def blocks_undone(sizes: list[int], order: list[int]) -> tuple[list[int], list[int]]:
    """The ``(sizes, order)`` that put blocks regrouped by ``(sizes, order)`` back in place."""
    return [sizes[i] for i in order], sorted(range(len(order)), key=order.__getitem__)


class _Blocks(torch.autograd.Function):
    """Rows regrouped block by block, the blocks' sizes and new order known on the host: one
    ``cat`` of slices each way, no index tensor, no sort."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sizes: list[int], order: list[int]):
        ctx.undo = blocks_undone(sizes, order)
        return _cat_blocks(rows, sizes, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _cat_blocks(grad, *ctx.undo), None, None


def _cat_blocks(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    pieces = rows.split(sizes)
    return torch.cat([pieces[i] for i in order])


def regroup_blocks(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """``rows``, cut into consecutive blocks of ``sizes`` rows, with the blocks in ``order``
    (block ``order[j]`` goes ``j``-th); the gradient goes back the same way (:class:`_Blocks`)."""
    return _Blocks.apply(rows, sizes, order)


def to_experts(
    tokens: torch.Tensor,
    order: torch.Tensor,
    inverse: torch.Tensor,
    k: int,
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rows[r] = tokens[order[r] // k]`` for a permutation ``order`` of the ``T * k`` slots
    (``inverse`` its inverse); backward gathers, no atomics, and takes only the ``held`` slots'
    gradients if given (:class:`_ToExperts`)."""
    return _ToExperts.apply(tokens, order, inverse, k, held)


def to_slots(rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows in ``order`` back in slot order: ``rows[inverse]``, gathers both ways."""
    return _Permute.apply(rows, inverse, order)


def group_by_expert(
    flat: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, inverse, bounds)`` of the flat slots' expert ids ``flat`` (global ids below
    ``count``; -1 for a dropped slot): ``order`` sorts them by expert, dropped ones first and
    token order inside each expert, ``inverse`` undoes it, ``bounds [count + 1]`` is each
    expert's first sorted slot, so ``bounds[0]`` counts the dropped slots and ``bounds.diff()``
    each expert's. Nothing waits for the GPU (an int64 index_add or bincount would: a slow,
    serial fallback kernel under compile, a host sync eager)."""
    grouped, order = torch.sort(narrow_ids(flat, count), stable=True)
    experts = torch.arange(count + 1, device=flat.device, dtype=grouped.dtype)
    bounds = torch.searchsorted(grouped, experts)
    return order, inverse_permutation(order), bounds


def mix_slots(per_slot: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, h]``: each token's ``k`` expert outputs (``per_slot [T, k, h]``) weighted by its
    routing probabilities and summed, in float32, then ``dtype``."""
    return (per_slot.float() * probs.float().unsqueeze(-1)).sum(1).to(dtype)


def complete_mixture(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    indices: torch.Tensor,
    experts: Experts,
    count: int,
    pad_to: int | None = None,
) -> torch.Tensor:
    """:func:`local_mixture` when every slot's expert is here: the slots are a permutation, so
    no shape depends on the data (a compiled layer is one graph, nothing waits for the GPU), and
    tokens move by gathers both ways, never by atomic scatter-adds."""
    t, k = indices.shape
    order, inverse, bounds = group_by_expert(indices.reshape(-1), count)
    y = run_experts(to_experts(tokens, order, inverse, k), bounds.diff(), experts, pad_to)
    return mix_slots(to_slots(y, order, inverse).view(t, k, -1), probs, tokens.dtype)


def held_mixture(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    indices: torch.Tensor,
    experts: Experts,
    first: int,
    count: int,
    total: int | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """:func:`local_mixture` of the slots held here among others (expert parallelism's
    ``allgather``, a capacity that drops), without a shape that depends on the routing: every
    one of the ``T * k`` slots is sorted, the held ones first by expert, the rest after them,
    and the experts run on the groups at the front (:func:`experts_on_prefix`: on a GPU one
    grouped GEMM whose offsets stay on the device). Nothing waits for the GPU, and a compiled
    layer is one graph. Finding the held slots on the host instead (``nonzero``, ``bincount``)
    cost a sync per layer and micro-batch, and a graph break at each.

    The price: the rows sorted and gathered for the experts are all ``T * k`` slots, and the
    grouped GEMM's outputs have room for them all (``n`` times the held rows at ``n`` ranks of
    balanced routing), where the host-found slots needed only the held rows: at EP2 of issue
    46's MoE, 13.8 GiB of activations at the step's peak against DP2's 9.2 (one H200, a rank
    over the fake group, 2026-12-01). The rows past the groups are never read: the mixing
    takes the held slots' outputs alone, and backward the held slots' gradients alone."""
    t, k = indices.shape
    flat = indices.reshape(-1)
    local = flat - first
    held = (flat >= 0) & (local >= 0) & (local < count)
    order, inverse, bounds = group_by_expert(torch.where(held, local, count), count + 1)
    meta_rows = 0
    if indices.is_meta:  # balanced (module docstring)
        meta_rows = sum(
            balanced_rows(flat.numel(), total or count, capacity)[first : first + count]
        )
    rows = to_experts(tokens, order, inverse, k, held)
    y = experts_on_prefix(rows, bounds.diff()[:count], experts, meta_rows)
    per_slot = to_slots(y, order, inverse).view(t, k, -1)
    kept = torch.where(held.view(t, k, 1), per_slot, per_slot.new_zeros(()))
    return mix_slots(kept, probs, tokens.dtype)


# where grouped_on_gpu holds: GPUs (a test adds "cpu" to run a GPU's grouped GEMM on CPU ranks)
GROUPED_DEVICES = ("cuda",)


def grouped_gemm(rows: torch.Tensor, experts: Experts) -> bool:
    """Whether the experts run ``rows`` as one grouped GEMM where the device allows it (bf16,
    ``--moe-grouped-gemm``)."""
    return getattr(experts, "grouped_gemm", False) and rows.dtype == torch.bfloat16


def grouped_on_gpu(rows: torch.Tensor, experts: Experts) -> bool:
    """Whether the experts run ``rows`` as one grouped GEMM on a GPU (bf16): its offsets stay on
    the device, and it fills only the rows of its groups."""
    return rows.device.type in GROUPED_DEVICES and grouped_gemm(rows, experts)


def experts_on_prefix(
    x: torch.Tensor, counts: torch.Tensor, experts: Experts, meta_rows: int
) -> torch.Tensor:
    """The experts' outputs for ``x``'s first ``counts.sum()`` rows in groups of ``counts``,
    with as many rows as ``x``: past the groups, what the grouped GEMM on a GPU leaves there
    (nothing the caller reads), zero elsewhere (the expert loop, and the CPU, run the grouped
    rows alone: the host reads their number, as the loop does anyway). On meta (the planner)
    the first ``meta_rows`` rows are grouped (a balanced routing); a GPU's grouped GEMM is
    planned on every row, as it runs, its groups marked with the share they fill
    (:mod:`~mega.parallel.expert.filled_rows`: FLOPs for those rows, memory for all)."""
    if grouped_on_gpu(x, experts):
        return experts(x, counts)
    if x.is_meta and grouped_gemm(x, experts):  # a GPU's, planned: every row, the groups marked
        return experts(x, mark_filled(counts, meta_rows / max(x.shape[0], 1)))
    if x.is_meta:
        grouped = x[:meta_rows]
    elif traced():  # eager, its row count unbacked: one graph for every routing
        from mega.parallel.expert.traced import grouped_rows

        grouped = grouped_rows(x, counts)
    else:
        grouped = x[: int(counts.sum())]
    out = experts(grouped, counts)
    return torch.cat([out, out.new_zeros(x.shape[0] - grouped.shape[0], out.shape[1])])
