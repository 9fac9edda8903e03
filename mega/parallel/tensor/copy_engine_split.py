"""Sequence parallelism's forward collectives by the copy engine, split by token block:
``MEGA_TP_SPLIT_OVERLAP=copy-engine`` (experimental, opt-in; GPUs of one host).

:mod:`.split_overlap` hides the forward all-gather and reduce-scatter behind the own token
block's GEMM rows with NCCL's collectives. Measured under CUDA graphs (2 H200, 1.3B GPT, TP2 +
SP, micro-batch 4, 2026-11-30, session 52) that bought nothing (0.780x DP2 against 0.777x): NCCL's
kernels need SMs, which the own block's GEMM holds (the gathers ran 91 -> 115 us beside it and
were still exposed after it), and the own block's GEMM (68-90 us) is shorter than the gather it
should hide. The copy engine takes no SM: each rank copies its block straight into every peer's
inbox in symmetric memory (peer-mapped), on a side stream, while its SMs compute.

The two bodies, each one pass of a rank (``q`` runs over the other ranks of the group):

- column forward (``Y = gather(X) W^T``): side stream: wait for ``q``'s *free* token, copy this
  rank's block into slot ``me`` of ``q``'s inbox, put a *ready* token to ``q``. Current stream:
  the own block's rows, then for each ``q``: wait for its *ready* token, the rows of its block
  read from this rank's inbox slot ``q``, put a *free* token back to ``q`` (read: it may write
  there again). The side stream joins the current one before the op returns.
- row forward (``Y = reduce_scatter(X W^T)``): the rows of ``q``'s block first (partial sums),
  copied into slot ``me`` of ``q``'s inbox on the side stream as above while the own block's
  rows are computed, then the arrived partial sums are added to them as they arrive.

Tokens are symmetric memory's signals (a put waits for the flag to be clear, a wait clears it),
so every pass ends with the tokens where it began and a CUDA graph replays it as captured. The
inboxes (one per group and direction, as large as the largest block seen) are made by a
rendezvous of the group, which cannot happen inside a graph's capture: the warm-up run that
precedes every capture makes them. For two ranks the row forward's sum is the reduce-scatter's
(one addition of the same two values); for more, the additions run in the order the blocks
arrive (the previous rank's first), not NCCL's. The same inboxes carry tensor parallelism's
all-reduces without SP (:mod:`.copy_engine_reduce`) and the MoE's padded trips by the copy
engine or the peer-rows kernel (:mod:`mega.parallel.expert.copy_engine_exchange`, direction
``"flex"``).

- row backward (``dX = gather(dY) W``; the weight gradient on the gathered dY): as the column
  forward, each block's dX rows as the block arrives, the block copied out of the inbox for the
  weight gradient before its slot is given back.

- column backward (:mod:`.overlapped`'s order: gather X while ``dX = dY W`` is computed,
  reduce-scatter dX beside the weight gradient): X's block to the peers while the rows of dX
  that belong to the others are computed first and sent, then the own rows; the weight gradient
  on the gathered X while dX's partial sums travel; those added last. On 2 H200 NCCL's
  reduce-scatter there was half exposed (7.9 of 15.9 ms a step): it runs slower beside the GEMM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from mega.parallel.distributed import SIGNAL_TIMEOUT_MS as _TIMEOUT_MS

_READY, _FREE = 0, 1  # signal channels
_ALIGN = 512  # bytes: slots start aligned (a GEMM reads a block straight from its slot)


class _Inbox:
    """One rank's symmetric buffer for one direction of a group: a slot per sending rank, each of
    ``block_bytes``; with the side stream its copies run on."""

    def __init__(self, group: Any, block_bytes: int, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        size = torch.distributed.get_world_size(group)
        self.block_bytes = -(-block_bytes // _ALIGN) * _ALIGN  # every slot aligned for any view
        self.buffer = symm_mem.empty(size * self.block_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # the signal pad's clearing done before a peer puts
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.side = torch.cuda.Stream(device)
        me = self.handle.rank
        # from the next rank on: the ranks do not all copy into the same peer first
        self.peers = [(me + k) % size for k in range(1, size)]
        for q in self.peers:  # every peer may write its first block here
            self.handle.put_signal(q, _FREE, _TIMEOUT_MS)

    def slot(self, owner: int, sender: int, like: torch.Tensor) -> torch.Tensor:
        """Slot ``sender`` of ``owner``'s inbox, viewed as a tensor shaped like ``like``."""
        nbytes = like.numel() * like.element_size()
        if owner == self.handle.rank:
            raw = self.buffer[sender * self.block_bytes : sender * self.block_bytes + nbytes]
        else:
            raw = self.handle.get_buffer(owner, (nbytes,), torch.uint8, sender * self.block_bytes)
        return raw.view(like.dtype).view(like.shape)


# per (group, direction); an inbox a larger block replaced stays alive (the GPU may still read it)
_INBOXES: dict[tuple[str, str], _Inbox] = {}
_RETIRED: list[_Inbox] = []


def inbox_for(group: Any, direction: str, like: torch.Tensor) -> _Inbox:
    key, nbytes = (group.group_name, direction), like.numel() * like.element_size()
    inbox = _INBOXES.get(key)
    if inbox is None or inbox.block_bytes < nbytes:  # every rank grows at the same pass
        if torch.cuda.is_current_stream_capturing():  # a rendezvous is a host collective
            raise RuntimeError(
                "MEGA_TP_SPLIT_OVERLAP=copy-engine: the inbox cannot be made inside a CUDA graph's"
                " capture (a warm-up run makes it)"
            )
        if inbox is not None:
            inbox.side.synchronize()
            _RETIRED.append(inbox)
        # made on a thread of its own: the rendezvous allocates the peers' pointer tables from
        # the caching allocator, which inductor's graph trees route into their pool for the
        # thread that warms them up ("tensors in the cudagraph pool not tracked as outputs");
        # the inboxes outlive every graph, so they stay out of it
        made: list = []

        def make() -> None:
            try:
                torch.cuda.set_device(like.device)
                inbox = _Inbox(group, nbytes, like.device)
                torch.cuda.synchronize(like.device)
                made.append(inbox)
            except BaseException as error:  # raised again on the caller's thread
                made.append(error)

        maker = threading.Thread(target=make, name="mega-tp-inbox")
        maker.start()
        maker.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        inbox = _INBOXES[key] = made[0]
    return inbox


def send_blocks(
    inbox: _Inbox,
    blocks: dict[int, torch.Tensor],
    copy: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """On the side stream, after what the current stream has queued: ``blocks[q]`` into slot
    ``me`` of ``q``'s inbox once ``q`` has read the last one there, then ``q``'s ready token.
    ``copy(q, slot, block)`` writes it where the whole block need not cross (the MoE's
    peer-rows trips: its real rows only); by default the copy engine copies it whole."""
    handle, me = inbox.handle, inbox.handle.rank
    inbox.side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(inbox.side):
        for q in inbox.peers:
            handle.wait_signal(q, _FREE, _TIMEOUT_MS)
            slot = inbox.slot(q, me, blocks[q])
            if copy is None:
                slot.copy_(blocks[q])
            else:
                copy(q, slot, blocks[q])
            handle.put_signal(q, _READY, _TIMEOUT_MS)


def receive(inbox: _Inbox, like: torch.Tensor, use: Any) -> None:
    """For each peer ``q``, in the order their blocks are sent here (the previous rank's first:
    each rank sends to the next ranks first): wait for its block, ``use(q, block)`` on the
    current stream, then give its slot back."""
    handle = inbox.handle
    for q in reversed(inbox.peers):
        handle.wait_signal(q, _READY, _TIMEOUT_MS)
        use(q, inbox.slot(handle.rank, q, like))
        handle.put_signal(q, _FREE, _TIMEOUT_MS)
    torch.cuda.current_stream().wait_stream(inbox.side)  # joined: the blocks sent are read


def _gather_then(group: Any, direction: str, x_2d: torch.Tensor, use: Any) -> None:
    """``use(q, block)`` for every rank's token block of the group, this rank's own first (while
    the own block travels to the others), then the others' as they arrive."""
    inbox = inbox_for(group, direction, x_2d)
    send_blocks(inbox, dict.fromkeys(inbox.peers, x_2d))
    use(inbox.handle.rank, x_2d)
    receive(inbox, x_2d, use)


def column_forward(
    x_2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Any,
    rows: Any,
) -> torch.Tensor:
    """``[n*size, out/tp]``: every rank's token block ``x_2d`` (``[n, in]``) through this rank's
    columns; ``rows(x, weight, bias, out)`` writes one block's rows."""
    x_2d, n = x_2d.contiguous(), x_2d.shape[0]
    out = x_2d.new_empty(n * torch.distributed.get_world_size(group), weight.shape[0])

    def use(q: int, block: torch.Tensor) -> None:
        rows(block, weight, bias, out[q * n : (q + 1) * n])

    _gather_then(group, "column", x_2d, use)
    return out


def row_backward_gather(
    grad_out: torch.Tensor, x_2d: torch.Tensor, weight: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-parallel backward's gather of dY by blocks: (dX ``[N, in/tp]``, the gathered dY
    ``[N, out]`` for the weight gradient), each block's dX rows computed as it arrives."""
    grad_out, n = grad_out.contiguous(), grad_out.shape[0]
    gathered = grad_out.new_empty(x_2d.shape[0], grad_out.shape[1])
    grad_x = x_2d.new_empty(x_2d.shape)

    def use(q: int, block: torch.Tensor) -> None:
        torch.mm(block, weight, out=grad_x[q * n : (q + 1) * n])
        gathered[q * n : (q + 1) * n].copy_(block)  # out of the inbox before it is given back

    _gather_then(group, "row-backward", grad_out, use)
    return grad_x, gathered


def column_backward(
    grad_2d: torch.Tensor, x_2d: torch.Tensor, weight: torch.Tensor, group: Any, wgrad: Any
) -> tuple[torch.Tensor, Any]:
    """The column-parallel backward under sequence parallelism (:mod:`.overlapped`'s order, its
    two collectives by the copy engine): this rank's token block of ``dX = dY W`` summed over
    the ranks, and ``wgrad(dY, X)`` on the gathered input. ``x_2d``'s block travels while dX's
    rows are computed (the others' blocks first: their partial sums travel beside the own rows
    and the weight gradient); what arrived is added last."""
    size = torch.distributed.get_world_size(group)
    me, n = torch.distributed.get_rank(group), x_2d.shape[0]
    x_2d = x_2d.contiguous()
    gather = inbox_for(group, "column-backward-x", x_2d)
    send_blocks(gather, dict.fromkeys(gather.peers, x_2d))
    partial = {q: grad_2d[q * n : (q + 1) * n].mm(weight) for q in range(size) if q != me}
    reduce = inbox_for(group, "column-backward-dx", next(iter(partial.values())))
    send_blocks(reduce, partial)
    own = grad_2d[me * n : (me + 1) * n].mm(weight)
    inputs = x_2d.new_empty(n * size, x_2d.shape[1])
    inputs[me * n : (me + 1) * n].copy_(x_2d)

    def place(q: int, block: torch.Tensor) -> None:
        inputs[q * n : (q + 1) * n].copy_(block)  # out of the inbox before it is given back

    receive(gather, x_2d, place)
    grad_weight = wgrad(grad_2d, inputs)  # while dX's partial sums travel

    def add(q: int, block: torch.Tensor) -> None:
        own.add_(block)

    receive(reduce, own, add)
    return own, grad_weight


def row_forward(x_2d: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
    """``[N/size, out]``: this rank's token block of ``sum over ranks of x_2d weight^T``."""
    size = torch.distributed.get_world_size(group)
    me, n = torch.distributed.get_rank(group), x_2d.shape[0] // size
    partial = {q: x_2d[q * n : (q + 1) * n].mm(weight.t()) for q in range(size) if q != me}
    inbox = inbox_for(group, "row", next(iter(partial.values())))
    send_blocks(inbox, partial)
    own = x_2d[me * n : (me + 1) * n].mm(weight.t())  # while the others' rows travel

    def use(q: int, block: torch.Tensor) -> None:
        own.add_(block)

    receive(inbox, own, use)
    return own
