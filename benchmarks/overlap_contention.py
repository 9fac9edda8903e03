"""What a collective running beside compute costs the compute: the planner's missing rate.

    torchrun --nproc-per-node 2 benchmarks/overlap_contention.py
    torchrun --nproc-per-node 2 benchmarks/overlap_contention.py --device cpu --tokens 64 \
        --hidden 32 --ffn 64 --gemms 2 --collective-mib 1 --iters 2 --warmup 1   # a smoke run

Why: on 2 H200 (2026-11-30, c1c71fd) `mega plan` planned the MoE's DP2 step 24% short. Its
profile ran 26 gradient reduce-scatters (50 ms a step), 47 ms of them beside compute, and its
GEMMs took 17% longer per micro-batch than one GPU's; the planner counts an overlapped
collective as free for the compute beside it. This measures that cost on its own: a chain of
bf16 GEMMs of a layer's shape (``[tokens, hidden] x [hidden, ffn]`` and back), alone; the
collective alone (a reduce-scatter of fp32, a gradient bucket's size, and an all-to-all of bf16,
a padded flex trip's); and each collective started, then the same GEMMs beside it. Per row the
medians over ``--iters`` (every rank in step: a barrier before each), the GEMMs' slowdown
beside the collective, and the collective's wall time beside them against alone.

Rank 0 writes ``<out>/<name>_<date>.json`` with the provenance of every result file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from result_file import write_json


class Clock:
    """Milliseconds of a section on the device: CUDA events on GPUs, the host's clock after the
    work is done on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __enter__(self) -> Clock:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.elapsed = (time.perf_counter() - self.t0) * 1000

    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return self.elapsed


def gemm_chain(tokens: int, hidden: int, ffn: int, gemms: int, device: torch.device) -> Callable:
    """``gemms`` pairs of GEMMs, up to ``ffn`` and back, as a layer's MLP runs them."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    up = torch.randn(hidden, ffn, device=device, dtype=dtype) / hidden**0.5
    down = torch.randn(ffn, hidden, device=device, dtype=dtype) / ffn**0.5

    def run() -> torch.Tensor:
        y = x
        for _ in range(gemms):
            y = (y @ up) @ down
        return y

    return run


def collectives(mib: float, world: int, device: torch.device) -> dict[str, Callable]:
    """Each collective, started: returns its work handle."""
    rs_numel = int(mib * 2**20 / 4) // world * world
    rs_in = torch.randn(rs_numel, device=device)
    rs_out = torch.empty(rs_numel // world, device=device)
    a2a_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a2a_numel = int(mib * 2**20 / 2) // world * world
    a2a_in = torch.randn(a2a_numel, device=device, dtype=a2a_dtype)
    a2a_out = torch.empty_like(a2a_in)
    return {
        "reduce_scatter_fp32": lambda: dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True),
        "all_to_all_bf16": lambda: dist.all_to_all_single(a2a_out, a2a_in, async_op=True),
    }


def measure(gemms: Callable, start: Callable, cuda: bool, iters: int, warmup: int) -> dict:
    """Medians of the GEMMs alone, the collective alone, and both at once."""
    samples = []
    for _ in range(warmup + iters):
        dist.barrier()
        with Clock(cuda) as gemms_alone:
            gemms()
        dist.barrier()
        with Clock(cuda) as comm_alone:
            start().wait()
        dist.barrier()
        with Clock(cuda) as together:
            work = start()
            with Clock(cuda) as gemms_beside:
                gemms()
            work.wait()
        clocks = (gemms_alone, comm_alone, gemms_beside, together)
        samples.append([clock.ms() for clock in clocks])
    columns = zip(*samples[warmup:], strict=True)
    alone, comm, beside, both = (statistics.median(column) for column in columns)
    row = {
        "gemms_alone_ms": alone,
        "collective_alone_ms": comm,
        "gemms_beside_ms": beside,
        "both_ms": both,
    }
    row["gemm_slowdown"] = row["gemms_beside_ms"] / row["gemms_alone_ms"]
    # what running them together saved against one after the other (1: nothing hidden)
    row["both_vs_serial"] = row["both_ms"] / (row["gemms_alone_ms"] + row["collective_alone_ms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="a micro-batch's, 4 x 2048")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--gemms", type=int, default=8, help="pairs of GEMMs per measurement")
    parser.add_argument("--collective-mib", type=float, default=288.0, help="a gradient bucket")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="overlap_contention")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()

    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    gemms = gemm_chain(args.tokens, args.hidden, args.ffn, args.gemms, device)
    rows = []
    for name, start in collectives(args.collective_mib, world, device).items():
        row = {"collective": name, "mib": args.collective_mib}
        row.update(measure(gemms, start, cuda, args.iters, args.warmup))
        rows.append(row)
        if dist.get_rank() == 0:
            print(row, flush=True)
    if dist.get_rank() == 0:
        shape = {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn}
        shape["gemm_pairs"] = args.gemms
        path = write_json(
            Path(args.out), args.name, {"world_size": world, **shape, "results": rows}
        )
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
