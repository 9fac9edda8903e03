"""The expert all-to-all whose splits stay on the device: the ``flex`` dispatcher's two trips.

Why: the ``alltoall`` dispatcher brings each layer's per-expert counts to the host (one sync per
layer and micro-batch) and runs its two trips eager. On 2 H200 (issue 46's MoE, 2026-11-29) its
EP2 ran at 0.79x of DP2, while drop-and-pad, the same all-to-all bytes with fixed splits and no
sync, ran at 0.96x: the sync and the broken graph, not the bytes, are what EP2 pays.

What the two trips are, for ``n`` ranks holding ``local`` experts each, this rank's ``S`` rows
(its routed slots, sorted by global expert: by destination rank, then its local expert):

- ``dispatch_rows(rows, splits)``: ``splits [n * local]`` counts the rows per (rank, expert).
  Returns ``arrived [n * S + local * a, h]``, expert-major (each local expert's blocks from
  every source rank together, in source order, experts in order), and ``layout [2, n * local]``:
  the size and the first row of the block at ``expert * n + source``. Each expert's room is
  rounded up to ``a`` rows (:func:`arrival_align`) and is at least ``a`` rows (NVSHMEM's kernel
  gives every expert at least its alignment, 1 here; the padded transport aligns to 8), so the
  experts' rows are *not* the sizes' running sum: :func:`expert_groups` reads them from the
  layout, :func:`block_rows` says which rows hold a block. ``n * S + local * a`` rows hold any
  routing (every rank may send all of its rows here, every other expert empty); the rows outside
  the blocks are padding, whose values mean nothing.
- ``combine_rows(outputs, layout, splits)``: the experts' output rows (``layout``'s blocks of
  ``outputs [n * S + local * a, h]``) back to the ranks they came from, in the order they left:
  ``[S, h]``.

Each is the other's gradient. No shape depends on the routing: a compiled MoE layer is one graph
(each trip one opaque custom op), and nothing waits for the GPU.

Transports (``MEGA_FLEX_TRANSPORT``, :mod:`mega.parallel.expert.validate`): by default GPUs carry
the trips by the padded all-to-alls of :mod:`mega.parallel.expert.padded_exchange` (the same
contract, and faster on 2 H200); ``split`` keeps the exact splits of this module. On CUDA those
go by torch's NVSHMEM all-to-alls with the splits on the device
(``symm_mem.all_to_all_vdev_2d`` and its ``_offset`` reverse, which reorders rank-major blocks
to expert-major and back), through symmetric buffers this module keeps per shape. Two sets of
buffers alternate: a rank copies its next rows into a set only after the trip that used the
other set, whose start every rank must reach, so no peer still reads the set being overwritten.
NVSHMEM's kernels address ranks by their number in the world and synchronise all of them: the
expert-parallel group must be the world (EP equal to the GPU count), at most 16 ranks and 16
local experts (the kernels' tile limits). Elsewhere (CPU ranks over gloo) the same contract by
c10d, an empty expert's padding row included: the counts are exchanged and read on the host (a
sync, as ``alltoall``'s), the rows exchanged and regrouped. On the meta device
(``mega plan``) the routing is balanced, as every dispatcher's there: each rank receives ``S``
rows, and the planner sees an all-to-all of them each way.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from mega.errors import MegaRunError, first_line
from mega.parallel.expert import padded_exchange
from mega.parallel.expert.local import balanced_rows
from mega.parallel.expert.validate import (
    FLEX_MOST_LOCAL_EXPERTS,
    flex_layout_problems,
    padded_trips,
)
from mega.parallel.functional_comm import all_to_all_rows
from mega.parallel.weight_grad import OpaqueWhenTraced

# torch's 2D kernel moves each (rank, expert) block with one thread block of its own, at most 64 on
# one node. At EP2 with 4 local experts that is 8 thread blocks, and a trip of issue 46's MoE
# (33 MB to the peer) took 1.9 ms on 2 H200 (2026-11-29), 4x NCCL's all-to-all of the same rows.
KERNEL_MOST_BLOCKS = 64


def pieces_per_expert(n: int, local: int, device: torch.device | None = None) -> int:
    """Into how many pieces the flex dispatcher cuts each (rank, expert) block, each piece a
    sub-expert of its own to the kernels: as many as keep ``n * local * pieces`` within the
    kernel's thread blocks and ``local * pieces`` within its experts. An expert's pieces lie
    together in the expert-major layout, so the expert still sees its rows as one group. One
    where the padded all-to-alls carry the trips (no NVSHMEM kernel to feed; ``device``: the
    data's, :func:`~mega.parallel.expert.validate.padded_trips`)."""
    if padded_trips(device):
        return 1
    return max(1, min(FLEX_MOST_LOCAL_EXPERTS // local, KERNEL_MOST_BLOCKS // (n * local)))


def split_in_pieces(splits: torch.Tensor, pieces: int) -> torch.Tensor:
    """``[len(splits) * pieces]``: each count cut into ``pieces`` parts that differ by one row at
    most, in order (a block's rows stay in order, its pieces one after another). On the device."""
    if pieces == 1:
        return splits
    extra = torch.arange(pieces, device=splits.device) < (splits % pieces).unsqueeze(1)
    return ((splits // pieces).unsqueeze(1) + extra).reshape(-1)


def arrival_align(device: torch.device | None = None) -> int:
    """``a``: the rows each expert's room in ``arrived`` is a multiple of (module docstring;
    ``device``: the data's)."""
    return padded_exchange.GROUP_ALIGN if padded_trips(device) else 1


def sent_rows(arrived_rows: int, n: int, local: int, device: torch.device | None = None) -> int:
    """``S``, the rows a rank sent, from the arrival's ``n * S + local * a`` rows."""
    return (arrived_rows - local * arrival_align(device)) // n


def expert_groups(layout: torch.Tensor, n: int, local: int) -> torch.Tensor:
    """``[local]``: the rows of each local expert's group for a grouped GEMM over ``arrived``:
    its room, the padding after its blocks included, up to where the next expert's room begins
    (so every group but the last is a multiple of the alignment); the last ends with its blocks.
    From the layout on the device: no host sync."""
    firsts = layout[1].view(local, n)[:, 0]  # where each expert's room begins
    ends = torch.cat([firsts[1:], (layout[0] + layout[1])[-1:]])
    return torch.diff(ends, prepend=ends.new_zeros(1))


def block_rows(layout: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]`` bool: which rows of ``arrived`` hold a block (the others are padding)."""
    sizes, starts = layout[0], layout[1]
    edges = torch.zeros(rows + 1, dtype=torch.int64, device=layout.device)
    edges.index_add_(0, starts, torch.ones_like(starts))
    edges.index_add_(0, starts + sizes, -torch.ones_like(starts))
    return torch.cumsum(edges, 0)[:rows] > 0


# -------------------------------------------------------------------------- c10d (CPU ranks)


def _exchange_sizes(sizes: torch.Tensor, group: Any, n: int, local: int) -> torch.Tensor:
    """``sizes`` viewed ``[n, local]``, row ``r`` to rank ``r``: the rows every rank sent here,
    ``[n, local]`` by source."""
    return all_to_all_rows(sizes.view(n, local), [1] * n, [1] * n, group)


def _c10d_dispatch(
    rows: torch.Tensor, splits: torch.Tensor, group: Any, n: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    received = _exchange_sizes(splits, group, n, local)  # [source, expert]
    host = torch.cat([splits, received.reshape(-1)]).tolist()  # the host reads the counts here
    sent, got = host[: n * local], host[n * local :]
    send = [sum(sent[r * local : (r + 1) * local]) for r in range(n)]
    arrived = all_to_all_rows(
        rows, send, [sum(got[s * local : (s + 1) * local]) for s in range(n)], group
    )
    pieces = arrived.split(got)  # by source, then expert
    sizes = received.t().reshape(-1)  # expert-major
    starts = padded_exchange.padded_offsets(sizes, n, local)
    out = rows.new_zeros(n * rows.shape[0] + local, rows.shape[1])
    for (e, s), start in zip(
        ((e, s) for e in range(local) for s in range(n)), starts.tolist(), strict=True
    ):
        piece = pieces[s * local + e]
        out[start : start + piece.shape[0]] = piece
    return out, torch.stack([sizes, starts])


def _c10d_combine(
    outputs: torch.Tensor, layout: torch.Tensor, group: Any, n: int, local: int
) -> torch.Tensor:
    sizes, starts = layout.tolist()  # the host reads the counts here
    # the block of (expert e, source s) goes back to s; to each source its blocks in expert order
    per_source = layout[0].view(local, n).t()  # [source, expert]
    back = _exchange_sizes(per_source, group, n, local).reshape(-1).tolist()  # [holder, expert]
    pieces = [
        outputs[starts[e * n + s] : starts[e * n + s] + sizes[e * n + s]]
        for s in range(n)
        for e in range(local)
    ]
    send = [sum(sizes[e * n + s] for e in range(local)) for s in range(n)]
    recv = [sum(back[r * local : (r + 1) * local]) for r in range(n)]
    rows = torch.cat(pieces) if pieces else outputs[:0]
    return all_to_all_rows(rows, send, recv, group)


# ---------------------------------------------------------------------- NVSHMEM (CUDA ranks)

_NVSHMEM_READY: set[str] = set()
# NVSHMEM's symmetric heap, fixed when it starts (its NVSHMEM_SYMMETRIC_SIZE, 1 GiB by default):
# unless the user set it, room for four times the first trip's two buffer sets (the other trip's
# and the backward's shapes come later), at least 2 GiB. At EP4, 16k routed rows of 2048 bf16,
# one trip's sets alone take 0.8 GB.
_HEAP = "NVSHMEM_SYMMETRIC_SIZE"


def _size_heap(needed: int) -> None:
    if _HEAP not in os.environ:
        os.environ[_HEAP] = str(max(2 << 30, 4 * needed))


def _nvshmem(group_name: str, device: torch.device, n: int, local: int) -> Any:
    """torch's symmetric memory on its NVSHMEM backend, set up for ``group_name`` once."""
    from torch.distributed import _symmetric_memory as symm_mem

    if group_name not in _NVSHMEM_READY:
        problems = flex_layout_problems(n, dist.get_world_size(), local)
        if problems:
            raise MegaRunError(problems[0])
        try:
            if not symm_mem.is_nvshmem_available():
                raise RuntimeError("this torch build or machine has no NVSHMEM")
            if symm_mem.get_backend(device) != "NVSHMEM":
                symm_mem.set_backend("NVSHMEM")
            with warnings.catch_warnings():  # deprecated (a no-op) on newer torch
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group_name)
        except Exception as exc:
            raise MegaRunError(
                "--moe-token-dispatcher-type flex on GPUs needs torch's NVSHMEM symmetric memory"
                f" ({first_line(exc)}); use alltoall"
            ) from exc
        _NVSHMEM_READY.add(group_name)
    return symm_mem


class _Buffers:
    """One trip's symmetric tensors: rows in, rows out, the splits in and the layout out."""

    def __init__(
        self, symm_mem: Any, rows_in: int, rows_out: int, like: torch.Tensor, nsplits: int
    ):
        h, dtype, device = like.shape[1], like.dtype, like.device
        self.rows_in = symm_mem.empty(rows_in, h, dtype=dtype, device=device).zero_()
        self.rows_out = symm_mem.empty(rows_out, h, dtype=dtype, device=device).zero_()
        self.splits_in = symm_mem.empty(2, nsplits, dtype=torch.int64, device=device).zero_()
        self.layout_out = symm_mem.empty(2, nsplits, dtype=torch.int64, device=device).zero_()


_BUFFERS: dict[tuple, list[_Buffers]] = {}
_TURNS: dict[tuple, int] = {}


def _buffers(
    group_name: str,
    kind: str,
    rows_in: int,
    rows_out: int,
    like: torch.Tensor,
    nsplits: int,
    local: int,
) -> _Buffers:
    """The next of the two alternating buffer sets for this trip's shapes (module docstring)."""
    key = (group_name, kind, rows_in, rows_out, like.shape[1], like.dtype, like.device, nsplits)
    if key not in _BUFFERS:
        _size_heap(2 * (rows_in + rows_out) * like.shape[1] * like.element_size())
        symm_mem = _nvshmem(group_name, like.device, nsplits // local, local)
        try:
            _BUFFERS[key] = [_Buffers(symm_mem, rows_in, rows_out, like, nsplits) for _ in range(2)]
        except Exception as exc:  # the heap is full: say which setting sizes it
            raise MegaRunError(
                f"--moe-token-dispatcher-type flex: symmetric buffers of {rows_out} rows do not"
                f" fit NVSHMEM's heap ({first_line(exc)}); set {_HEAP} larger (now"
                f" {os.environ.get(_HEAP)} bytes)"
            ) from exc
        _TURNS[key] = 0
    _TURNS[key] ^= 1
    return _BUFFERS[key][_TURNS[key]]


def holds_buffers() -> bool:
    """Whether this process made symmetric buffers (a flex run on GPUs)."""
    return bool(_BUFFERS)


def release_buffers() -> None:
    """Free the symmetric buffers now, on every rank at the same point (freeing is collective in
    NVSHMEM: left to the interpreter's teardown, ranks may free in different orders or not at
    all before the process group is gone)."""
    _BUFFERS.clear()
    _TURNS.clear()


def _nvshmem_dispatch(
    rows: torch.Tensor, splits: torch.Tensor, group_name: str, n: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    s = rows.shape[0]
    b = _buffers(group_name, "dispatch", s, n * s + local, rows, n * local, local)
    b.rows_in.copy_(rows)
    b.splits_in[0].copy_(splits)
    # rank-major blocks in, expert-major out, each expert aligned to 1 row (an empty one still
    # takes a row: the module docstring)
    torch.ops.symm_mem.all_to_all_vdev_2d(
        b.rows_in, b.rows_out, b.splits_in[0], b.layout_out, group_name, 1
    )
    return b.rows_out.clone(), b.layout_out.clone()


def _nvshmem_combine(
    outputs: torch.Tensor, layout: torch.Tensor, group_name: str, n: int, local: int
) -> torch.Tensor:
    s = sent_rows(outputs.shape[0], n, local, outputs.device)
    b = _buffers(group_name, "combine", n * s + local, s, outputs, n * local, local)
    b.rows_in.copy_(outputs)
    b.splits_in.copy_(layout)
    torch.ops.symm_mem.all_to_all_vdev_2d_offset(
        b.rows_in, b.rows_out, b.splits_in, b.layout_out, group_name
    )
    return b.rows_out.clone()


# ------------------------------------------------------------------ the trips, by transport


def _meta_dispatch(
    rows: torch.Tensor, n: int, local: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced (module docstring): ``S`` rows go out and ``S`` come in, as an all-to-all."""
    share = balanced_rows(rows.shape[0], n)
    all_to_all_rows(rows, share, share, group)  # the planner counts its bytes
    return _arrival_like(rows, n, local)


def _arrival_like(rows: torch.Tensor, n: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rows.new_empty(n * rows.shape[0] + local, rows.shape[1]), rows.new_empty(
        2, n * local, dtype=torch.int64
    )


def _dispatch_body(
    rows: torch.Tensor, splits: torch.Tensor, group_name: str, n: int, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    group = _resolve_process_group(group_name)
    if rows.is_meta:
        return _meta_dispatch(rows, n, local, group)
    if rows.is_cuda:
        return _nvshmem_dispatch(rows, splits, group_name, n, local)
    return _c10d_dispatch(rows, splits, group, n, local)


def _combine_body(
    outputs: torch.Tensor, layout: torch.Tensor, group_name: str, n: int, local: int
) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    if outputs.is_meta:
        s = sent_rows(outputs.shape[0], n, local, outputs.device)
        share = balanced_rows(s, n)
        return all_to_all_rows(outputs[:s], share, share, group)
    if outputs.is_cuda:
        return _nvshmem_combine(outputs, layout, group_name, n, local)
    return _c10d_combine(outputs, layout, group, n, local)


_dispatch = OpaqueWhenTraced("mega::expert_dispatch_rows", _dispatch_body)
_combine = OpaqueWhenTraced("mega::expert_combine_rows", _combine_body)


@_dispatch.op.register_fake
def _(rows, splits, group_name, n, local):
    return _arrival_like(rows, n, local)


@_combine.op.register_fake
def _(outputs, layout, group_name, n, local):
    return outputs.new_empty(
        sent_rows(outputs.shape[0], n, local, outputs.device), outputs.shape[1]
    )


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, splits: torch.Tensor, group_name: str, n: int, local: int):
        arrived, layout = _dispatch(rows, splits, group_name, n, local)
        ctx.save_for_backward(layout)
        ctx.args = group_name, n, local
        ctx.mark_non_differentiable(layout)
        return arrived, layout

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _layout_grad: Any):
        (layout,) = ctx.saved_tensors
        return _combine(grad, layout, *ctx.args), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        outputs: torch.Tensor,
        layout: torch.Tensor,
        splits: torch.Tensor,
        group_name: str,
        n: int,
        local: int,
    ):
        ctx.save_for_backward(splits)
        ctx.args = group_name, n, local
        return _combine(outputs, layout, group_name, n, local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (splits,) = ctx.saved_tensors
        # the same splits give the same expert-major layout as the forward's dispatch
        grad_outputs, _ = _dispatch(grad, splits, *ctx.args)
        return grad_outputs, None, None, None, None, None


def dispatch_rows(
    rows: torch.Tensor, splits: torch.Tensor, group: Any, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(arrived [n * S + local * a, h], layout [2, n * local])`` (module docstring; ``a``
    is :func:`arrival_align`); differentiable."""
    n = dist.get_world_size(group)
    if padded_trips(rows.device):
        return padded_exchange.dispatch(rows, splits, group, n, local)
    return _Dispatch.apply(rows, splits, group.group_name, n, local)


def combine_rows(
    outputs: torch.Tensor, layout: torch.Tensor, splits: torch.Tensor, group: Any, local: int
) -> torch.Tensor:
    """``[S, h]``: the blocks of ``outputs`` back in the order :func:`dispatch_rows` took them
    (``splits`` its splits); differentiable."""
    n = dist.get_world_size(group)
    if padded_trips(outputs.device):
        return padded_exchange.combine(outputs, layout, splits, group, n, local)
    return _Combine.apply(outputs, layout, splits, group.group_name, n, local)
