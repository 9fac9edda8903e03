"""The ``flex`` MoE dispatcher's two trips timed alone, every rank in step, against NCCL's
all-to-all of the same rows (what the ``alltoall`` dispatcher sends, its splits on the host).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/flex_trips.py

Why: in a 2-H200 EP2 step of issue 46's MoE (2026-11-29, 65b3517) flex's trips took 48 ms of
data kernels and 49 ms of split-exchange kernels a step (four exchanges per layer and
micro-batch, 0.5 ms each), the step 250 ms. A trip alone, with no rank late, tells whether the
exchange costs that much by itself (its one thread block, NVSHMEM's barrier) or waited for a late
peer inside the step, which is what decides between hiding the trips behind the experts' GEMMs
and cutting their number.

Per row (``--rows`` routed rows per rank, ``--hidden`` bf16 columns, ``--local`` experts per
rank, each (rank, expert) block cut in ``pieces``; balanced random routing): the median
milliseconds of the dispatch, of the combine, and of NCCL's ``all_to_all_single`` of the same rows
(CUDA events around each, a barrier and a sync before each call), and from a profile of
``--profiled`` calls the device time per call of NVSHMEM's split exchange and data kernels (and
of NCCL's kernels). ``--transports split,padded`` times each transport of flex's trips
(``MEGA_FLEX_TRANSPORT``: NVSHMEM, or NCCL all-to-alls of fixed splits, whose blocks are not cut
in pieces). Rank 0 writes ``<out>/<name>_<date>.json`` with the commit, command, device and
versions.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from collective_bandwidth import timed
from result_file import with_provenance

from mega.parallel.expert.split_exchange import (
    combine_rows,
    dispatch_rows,
    pieces_per_expert,
    release_buffers,
    split_in_pieces,
)


def kernel_ms(run: Callable[[], object], calls: int) -> dict[str, float]:
    """Device milliseconds per call of NVSHMEM's split exchange and data kernels in ``run``."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            dist.barrier()
            run()
        torch.cuda.synchronize()
    totals = {"exchange_ms": 0.0, "data_ms": 0.0, "nccl_ms": 0.0}
    for event in prof.key_averages():
        name = event.key
        if "exchangeSplitAndOffset" in name:
            totals["exchange_ms"] += event.device_time_total / 1e3
        elif "allToAllV" in name:
            totals["data_ms"] += event.device_time_total / 1e3
        elif name.startswith("ncclDevKernel"):
            totals["nccl_ms"] += event.device_time_total / 1e3
    return {k: round(v / calls, 4) for k, v in totals.items()}


def row(
    rows: int, hidden: int, local: int, pieces: int, transport: str, args: argparse.Namespace
) -> dict:
    os.environ["MEGA_FLEX_TRANSPORT"] = transport  # read at every trip
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    slots = torch.randint(0, n * local, (rows,), generator=gen)
    splits = torch.bincount(slots, minlength=n * local).cuda()
    pieced = split_in_pieces(splits, pieces)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    group = dist.group.WORLD
    arrived, layout = dispatch_rows(x, pieced, group, local * pieces)  # buffers made here
    send = splits.view(n, local).sum(1).tolist()
    recv_t = torch.empty_like(splits.view(n, local).sum(1))
    dist.all_to_all_single(recv_t, splits.view(n, local).sum(1).contiguous())
    recv = recv_t.tolist()
    nccl_out = x.new_empty(sum(recv), hidden)

    def dispatch() -> None:
        dispatch_rows(x, pieced, group, local * pieces)

    def combine() -> None:
        combine_rows(arrived, layout, pieced, group, local * pieces)

    def nccl() -> None:
        dist.all_to_all_single(nccl_out, x, recv, send)

    with torch.no_grad():
        result = {
            "transport": transport, "rows": rows, "hidden": hidden, "local": local,
            "pieces": pieces,
            "mib_per_rank": round(rows * hidden * 2 / 2**20, 1),
            "dispatch_ms": round(timed(dispatch, args.iters, args.warmup), 4),
            "combine_ms": round(timed(combine, args.iters, args.warmup), 4),
            "nccl_all_to_all_ms": round(timed(nccl, args.iters, args.warmup), 4),
            "dispatch_kernels": kernel_ms(dispatch, args.profiled),
            "combine_kernels": kernel_ms(combine, args.profiled),
        }  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,16384", help="routed rows per rank, each a row")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--local", type=int, default=4, help="experts per rank")
    parser.add_argument("--pieces", default="", help="pieces per block (default: 1 and flex's)")
    parser.add_argument("--transports", default="split,padded", help="MEGA_FLEX_TRANSPORT values")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--name", default="flex_trips")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    n = dist.get_world_size()
    os.environ["MEGA_FLEX_TRANSPORT"] = "split"  # flex's own pieces, for NVSHMEM
    pieces = sorted({1, pieces_per_expert(n, args.local)})
    if args.pieces:
        pieces = [int(p) for p in args.pieces.split(",")]
    rows = []
    for count in (int(r) for r in args.rows.split(",")):
        for transport in args.transports.split(","):
            for p in pieces if transport == "split" else [1]:
                rows.append(row(count, args.hidden, args.local, p, transport, args))
                if dist.get_rank() == 0:
                    print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        result = with_provenance({"world_size": n, "results": rows})
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}_{result['date']}.json").write_text(json.dumps(result, indent=2) + "\n")
    release_buffers()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
