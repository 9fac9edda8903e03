"""The NCCL collectives tensor parallelism runs, timed alone: all-reduce, all-gather and
reduce-scatter (and the all-to-all of equal blocks, the MoE's padded trip) of one TP activation (default ``[4, 2048, 2048]`` bf16, 32 MiB: the 1.3B GPT's
micro-batch) on every GPU of this machine, or the first ``--gpus``.

    torchrun --nproc-per-node 2 benchmarks/collective_bandwidth.py
    NCCL_PROTO=Simple torchrun --nproc-per-node 2 benchmarks/collective_bandwidth.py --name simple

Per collective: the median over ``--iters`` calls (CUDA events around each, after ``--warmup``,
every rank in step: a barrier before each call), the algorithm bandwidth (the full-size tensor's
bytes over the time) and the bus bandwidth (NCCL's measure: all-reduce moves 2(n-1)/n of it per
rank, the others (n-1)/n). Rank 0 writes ``benchmarks/results/<name>_<date>.json`` (``--out``)
with the environment's NCCL variables, the commit (``MEGA_BENCH_COMMIT`` or git), the device and
versions. A collective far below the bus bandwidth the machine reaches on 1 GiB tells that the
layouts' exposed communication is not only their size.

``--ring-mib`` adds the transfer of context parallelism's ring (``p2p``): every rank sends a block
to the next rank and receives one from the previous, as NCCL send/recv (what the ring runs) and as
a copy into the next rank's symmetric memory (CUDA's peer access, the copy engine; a barrier on
each side), bandwidth per rank (its block's bytes over the time). At CP4 and 16k the ring's 32 MiB
key/value block took 0.45-1.3 ms per step under compute, longer than the block's attention.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from parallel_layouts import commit

import mega


def timed(run, iters: int, warmup: int) -> float:
    """Median milliseconds of ``run()`` over ``iters`` calls after ``warmup``."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def ring_runs(numel: int, rank: int, world: int) -> dict:
    """The ring's step for a ``numel`` bf16 block: NCCL send/recv and the copy engine."""
    from torch.distributed import _symmetric_memory as symm_mem

    nxt, prev = (rank + 1) % world, (rank - 1) % world
    block = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    inbox = torch.empty_like(block)
    shared = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(shared, dist.group.WORLD)
    remote = handle.get_buffer(nxt, (numel,), torch.bfloat16)

    def nccl() -> None:
        ops = [dist.P2POp(dist.isend, block, nxt), dist.P2POp(dist.irecv, inbox, prev)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def copy_engine() -> None:
        handle.barrier()  # the next rank has read what was there
        remote.copy_(block)
        handle.barrier()  # and ours has arrived

    return {"ring_nccl_sendrecv": nccl, "ring_symmetric_memory_copy": copy_engine}


def ring_rows(sizes_mib: list[int], rank: int, world: int, iters: int, warmup: int) -> list[dict]:
    """Each rank's block to the next rank, one from the previous, per size."""
    rows = []
    for mib in sizes_mib if world > 1 else []:
        numel = mib * 2**19
        for name, run in ring_runs(numel, rank, world).items():
            ms = timed(run, iters, warmup)
            gb_s = round(numel * 2 / ms / 1e6, 1)
            rows.append({
                "collective": name, "shape": [numel], "mib": mib, "ms": round(ms, 4),
                "algbw_gb_s": gb_s, "busbw_gb_s": gb_s,
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,2048,2048", help="the full-size tensor, bf16")
    parser.add_argument("--sizes-mib", default="1,32,1024", help="also these sizes (MiB), flat")
    parser.add_argument("--ring-mib", default="", help="ring send/recv sizes (MiB), e.g. 32,64")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--name", default="collective_bandwidth")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    shapes = [tuple(int(s) for s in args.shape.split(","))]
    shapes += [(int(m) * 2**19,) for m in args.sizes_mib.split(",") if m]
    rows = []
    for shape in shapes:
        full = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        part = full.chunk(world)[rank].contiguous()
        nbytes = full.numel() * full.element_size()
        gathered, scattered, exchanged = (
            torch.empty_like(full),
            torch.empty_like(part),
            torch.empty_like(full),
        )
        runs = {
            "all_reduce": (partial(dist.all_reduce, full), 2 * (world - 1) / world),
            "all_gather": (
                partial(dist.all_gather_into_tensor, gathered, part),
                (world - 1) / world,
            ),
            "reduce_scatter": (
                partial(dist.reduce_scatter_tensor, scattered, full),
                (world - 1) / world,
            ),
            # equal blocks, block q to rank q: the MoE's padded trip (each rank's routed rows)
            "all_to_all": (
                partial(dist.all_to_all_single, exchanged, full),
                (world - 1) / world,
            ),
        }
        for name, (run, factor) in runs.items():
            ms = timed(run, args.iters, args.warmup)
            algbw = nbytes / ms / 1e6
            rows.append({
                "collective": name, "shape": list(shape), "mib": nbytes / 2**20, "ms": round(ms, 4),
                "algbw_gb_s": round(algbw, 1), "busbw_gb_s": round(algbw * factor, 1),
            })  # fmt: skip
    rows += ring_rows(
        [int(m) for m in args.ring_mib.split(",") if m], rank, world, args.iters, args.warmup
    )
    if rank == 0:
        date = datetime.date.today().isoformat()
        result = {
            "date": date, "commit": commit(), "command": " ".join([sys.executable, *sys.argv]),
            "device": torch.cuda.get_device_name(0), "world_size": world,
            "versions": {"mega": mega.__version__, "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
            "python": platform.python_version(),
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))},
            "results": rows,
        }  # fmt: skip
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}_{date}.json").write_text(json.dumps(result, indent=2) + "\n")
        for row in rows:
            print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
