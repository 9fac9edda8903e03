"""One rank of the flex trips' race probe on 2 GPUs (run by torchrun from
tests/test_gpu_moe_flex.py): many small NVSHMEM trips, each checked against the same trip by
c10d over NCCL (the CPU ranks' transport), in three modes: ``idle`` (nothing else on the GPU),
``busy`` (large GEMMs queued on another stream, so the trips' kernels start while the SMs are
taken) and ``empty-first`` (the first block of every trip empty).

Why: torch's 2D kernel (``allToAllV_2d``) lets thread block 0 overwrite, when its own copy is
done, the source offsets every other block reads when it starts (torch's own PR 192300 names
this write-after-read race). A block that starts after block 0 finished would read rows from the
wrong place. The overlapped schedule's race test failed on 2 H200 (2026-11-30); this probe says
whether the trips alone, in order, do too. Prints one line per mode:
``race probe MODE: T trips on N ranks, M wrong`` (M counts each rank's wrong trips). Without CUDA (``FLEX_RACE_CPU=1``, gloo) c10d stands in
for NVSHMEM too: the probe's own logic, checked on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mega.parallel.distributed import finish_job, leave_job
from mega.parallel.expert import split_exchange as sx

TRIPS = int(os.environ.get("FLEX_RACE_TRIPS", "200"))
ROWS, HIDDEN, LOCAL = 256, 16, 4


def _splits(gen: torch.Generator, n: int, empty_first: bool) -> torch.Tensor:
    """``[n * LOCAL]`` rows per (rank, expert), ``ROWS`` in all, some blocks empty."""
    weights = torch.rand(n * LOCAL, generator=gen) * (torch.rand(n * LOCAL, generator=gen) > 0.3)
    if empty_first:
        weights[0] = 0
    weights[-1] += 1e-3  # never all zero
    picks = torch.multinomial(weights, ROWS, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=n * LOCAL)


CUDA = os.environ.get("FLEX_RACE_CPU") != "1"
DEVICE = "cuda" if CUDA else "cpu"


def _trips(group: dist.ProcessGroup) -> tuple:
    """NVSHMEM's dispatch and combine on GPUs; on CPU ranks c10d's (the probe's logic alone)."""
    if not CUDA:
        return (
            lambda rows, splits, n, local: sx._c10d_dispatch(rows, splits, group, n, local),
            lambda out, layout, n, local: sx._c10d_combine(out, layout, group, n, local),
        )
    name = group.group_name
    return (
        lambda rows, splits, n, local: sx._nvshmem_dispatch(rows, splits, name, n, local),
        lambda out, layout, n, local: sx._nvshmem_combine(out, layout, name, n, local),
    )


def _wrong(rank: int, n: int, mode: str, group: dist.ProcessGroup) -> int:
    gen = torch.Generator().manual_seed(100 * rank + len(mode))
    dispatch, combine = _trips(group)
    busy = torch.cuda.Stream() if mode == "busy" and CUDA else None
    big = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16) if busy else None
    wrong = 0
    for _ in range(TRIPS):
        splits = _splits(gen, n, mode == "empty-first").to(DEVICE)
        # every row names its sender and place: a row read from the wrong place shows
        rows = (rank * 10_000 + torch.arange(ROWS, device=DEVICE)).float()
        rows = rows.unsqueeze(1).expand(ROWS, HIDDEN).contiguous()
        if busy is not None:
            busy.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(busy):
                for _ in range(4):
                    big @ big
        arrived, layout = dispatch(rows, splits, n, LOCAL)
        want, want_layout = sx._c10d_dispatch(rows, splits, group, n, LOCAL)
        held = sx.block_rows(want_layout, want.shape[0])
        outputs = arrived * 2 + 1  # what an expert gives back, per row
        back = combine(outputs, layout, n, LOCAL)
        want_back = sx._c10d_combine(want * 2 + 1, want_layout, group, n, LOCAL)
        bad = not torch.equal(layout, want_layout)
        bad = bad or not torch.equal(arrived[held], want[held])
        bad = bad or not torch.equal(back, want_back)
        wrong += int(bad)
    return wrong


def main() -> None:
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if CUDA:
        torch.cuda.set_device(rank)
    group = dist.group.WORLD
    for mode in ("idle", "busy", "empty-first"):
        wrong = torch.tensor([_wrong(rank, n, mode, group)], device=DEVICE)
        dist.all_reduce(wrong)
        if rank == 0:
            print(f"race probe {mode}: {TRIPS} trips on {n} ranks, {int(wrong)} wrong", flush=True)
    finish_job()  # the symmetric buffers freed on every rank at once (a collective free)
    leave_job()  # the group destroyed and collected: gloo's threads joined, not torn down at exit


if __name__ == "__main__":
    main()
