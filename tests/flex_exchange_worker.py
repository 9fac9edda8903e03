"""One rank of the ``flex`` dispatcher's trips checked against their contract (run by torchrun):
tests/test_moe_flex.py on CPU ranks (gloo: c10d's transport) and tests/test_gpu_moe_flex.py on
GPUs (NCCL: NVSHMEM's, with the host forbidden to read the GPU after the first call).

Every rank makes every rank's rows and splits from seeds, so it knows what must arrive here
without asking anyone: ``dispatch_rows`` must bring, expert-major, each source's block for each
local expert, and say where each block lies; ``combine_rows`` of rows scaled by the expert
rank's ``rank + 1`` must return each row scaled by its destination's; both gradients are the
opposite trips. Prints one line per rank when all holds.

``MEGA_FLEX_TRANSPORT=peer-rows`` on CPU ranks: the trip is gloo's all-to-all of the whole
blocks with every row past a block's real ones made NaN on arrival (what a peer-rows trip leaves
there is whatever its inbox held): the contract holds only if the real rows' counts are right
and the padded maps never read past them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mega.parallel.distributed import finish_job, leave_job
from mega.parallel.expert import copy_engine_exchange, padded_exchange
from mega.parallel.expert.copy_engine_exchange import copy_engine_usable
from mega.parallel.expert.split_exchange import (
    arrival_align,
    combine_rows,
    dispatch_rows,
    expert_groups,
)
from mega.parallel.tensor import copy_engine_split

ROWS, HIDDEN, LOCAL = 24, 16, int(os.environ.get("FLEX_LOCAL", "2"))


def made(source: int, n: int, call: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``source``'s rows ``[ROWS, HIDDEN]`` and splits ``[n * LOCAL]`` (summing to ``ROWS``,
    some empty) at call ``call``. The first local expert of rank ``call % n`` gets nothing from
    anyone: it still takes a row (NVSHMEM's layout), so the next expert's blocks start later."""
    gen = torch.Generator().manual_seed(1000 * call + source)
    weights = torch.rand(n * LOCAL, generator=gen)
    weights[(call % n) * LOCAL] = 0.0  # an empty expert
    if (weights > 0).sum() > 1:  # an empty block, where another block remains to draw from
        weights[(source + call) % (n * LOCAL)] = 0.0
    splits = torch.bincount(
        torch.multinomial(weights, ROWS, replacement=True, generator=gen), minlength=n * LOCAL
    )
    rows = torch.randn(ROWS, HIDDEN, generator=gen)
    return rows.to(device), splits.to(device)


def expected_arrival(
    rank: int, n: int, call: int, device: torch.device
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """The blocks that must arrive here (expert-major, sources in order), their sizes, and their
    first rows: one after another, each expert's room rounded up to the transport's alignment
    and at least one alignment (an expert with no row taking that much padding)."""
    align = arrival_align(device)
    blocks, sizes = {}, {}
    for source in range(n):
        rows, splits = made(source, n, call, device)
        starts = (torch.cumsum(splits, 0) - splits).tolist()
        for e in range(LOCAL):
            i = rank * LOCAL + e
            blocks[e, source] = rows[starts[i] : starts[i] + int(splits[i])]
            sizes[e, source] = int(splits[i])
    firsts, row = [], 0
    for e in range(LOCAL):
        for s in range(n):
            firsts.append(row)
            row += sizes[e, s]
        room = max(row - firsts[e * n], 1)
        row = firsts[e * n] + -(-room // align) * align
    order = [(e, s) for e in range(LOCAL) for s in range(n)]
    return [blocks[key] for key in order], [sizes[key] for key in order], firsts


def _garbage_past_the_real_rows(x: torch.Tensor, group, real=None) -> torch.Tensor:  # noqa: ANN001
    """A peer-rows trip on CPU ranks (module docstring): gloo carries the whole blocks, then
    every row past the real ones of each arrived block is NaN; what the sender says it sends
    must be what the receiver expects."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    if real is None:  # a trip of whole blocks (the counts)
        return out
    send_rows, recv_rows = real
    sent_here = torch.empty_like(send_rows)
    dist.all_to_all_single(sent_here, send_rows.contiguous(), group=group)
    assert torch.equal(sent_here, recv_rows), (sent_here, recv_rows)
    blocks = out.view(group.size(), x.shape[0] // group.size(), *x.shape[1:])
    for q, rows in enumerate(recv_rows.tolist()):
        blocks[q, rows:] = float("nan")
    return out


def main() -> None:
    cuda = torch.cuda.is_available() and os.environ.get("FLEX_DEVICE", "cpu") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    transport = os.environ.get("MEGA_FLEX_TRANSPORT")
    if cuda and transport == "copy-engine":  # not the fallback
        assert copy_engine_usable(group, torch.zeros(1, device=device))
    if cuda and transport == "peer-rows":
        assert copy_engine_exchange.peer_rows_usable(group, torch.zeros(1, device=device))
    if not cuda and transport == "peer-rows":
        padded_exchange.peer_rows_usable = lambda group, like: True
        copy_engine_exchange._trip = _garbage_past_the_real_rows
    for call in range(3):
        rows, splits = made(rank, n, call, device)
        rows.requires_grad_(True)
        # made before the window below: a host-to-device copy waits for the GPU
        grad = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(call)).to(device)
        if cuda and call == 2:  # buffers made: from now on nothing may wait for the GPU
            torch.cuda.set_sync_debug_mode("error")
        arrived, layout = dispatch_rows(rows, splits, group, LOCAL)
        scaled = arrived * (rank + 1)  # "the experts": each rank scales what it holds
        returned = combine_rows(scaled, layout, splits, group, LOCAL)
        (returned * grad).sum().backward()
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        assert arrived.shape[0] == n * ROWS + LOCAL * arrival_align(device)
        blocks, sizes, firsts = expected_arrival(rank, n, call, device)
        assert layout[0].tolist() == sizes, (layout[0].tolist(), sizes)
        assert layout[1].tolist() == firsts, (layout[1].tolist(), firsts)
        # the grouped GEMM's groups: each expert's room up to the next expert's, aligned
        ends = torch.cumsum(expert_groups(layout, n, LOCAL), 0).tolist()
        assert ends == [*firsts[n::n], firsts[-1] + sizes[-1]], (ends, firsts, sizes)
        assert all(g % arrival_align(device) == 0 for g in ends[:-1]), ends
        for block, first in zip(blocks, firsts, strict=True):
            torch.testing.assert_close(arrived[first : first + len(block)], block, rtol=0, atol=0)
        # each row back, scaled by its destination rank's factor; the gradient likewise
        destination = torch.repeat_interleave(
            torch.arange(n, device=device), splits.view(n, LOCAL).sum(1), output_size=ROWS
        )
        factor = (destination + 1).to(rows.dtype).unsqueeze(1)
        torch.testing.assert_close(returned, rows.detach() * factor, rtol=0, atol=0)
        torch.testing.assert_close(rows.grad, grad * factor, rtol=0, atol=0)
    if cuda and transport in ("copy-engine", "peer-rows"):  # the op ran
        assert any(key[1] == "flex" for key in copy_engine_split._INBOXES), "no such trip ran"
    print(f"rank {rank}: flex trips hold their contract", flush=True)
    finish_job()  # the symmetric buffers freed on every rank at once (a collective free)
    leave_job()  # the group destroyed and collected: gloo's threads joined, not torn down at exit


if __name__ == "__main__":
    main()
