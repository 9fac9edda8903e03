"""What the MoE layer's small and odd kernels cost on one GPU, each graph-replayed back to back
(a CUDA graph of many calls, so the host's launches are out of the time):

    python benchmarks/kernel_costs.py [--out DIR]

Why: ``mega plan`` counts an op that is not a GEMM by its bytes at the calibrated bandwidth (a
512 MiB elementwise op's) and every bf16 or fp32 GEMM at the bf16 GEMM rate. A profiled MoE DP2
rank (issue 46's MoE, one H200, 2026-12-02) spent ~10 ms a step more in its kernels outside the
GEMMs and attention than planned, and ~3 ms in the router's fp32 GEMMs planned at ~0.1. The
rows say which of the planner's assumptions hold for which kernels:

- ``mul`` at sizes from 8 KiB to 128 MiB moved: the fixed cost of one kernel (the smallest
  size's time) and where the bandwidth rate is reached;
- the routing's ops at the MoE's shapes (8,192 tokens, top-2, hidden 2048, 8 experts): the
  stable sort of the int8 expert ids and of int64 ones, a row gather (``index_select``) and an
  atomic row scatter-add (``index_add_``) of the 16,384 routed rows, a cumulative sum;
- the router's three fp32 GEMMs ([8192, 2048] x [2048, 8], its input gradient and its weight
  gradient), and the forward with TF32 allowed.

Per row the median of 10 replays of a graph of ``calls`` calls, per call (``gpu_timing.gpu_ms``). Writes
``<out>/<name>_<date>.json``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
from gpu_timing import gpu_ms
from result_file import write_json


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``fn``, ``calls`` of them captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (workspaces, lazy init)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    # the graph's replays timed as gpu_timing times any step: CUDA events around each, the median
    return gpu_ms(graph.replay, iters=1, warmup=3, repeats=10) * 1e3 / calls


def rows() -> list[dict]:
    out = []
    for nbytes in (4096, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        us = per_call_us(
            lambda x=x, y=y: torch.mul(x, 1.5, out=y), 200 if nbytes < 16 << 20 else 50
        )
        out.append(
            {"op": "mul", "bytes_moved": 2 * nbytes, "us": us, "gb_s": 2 * nbytes / us / 1e3}
        )
    tokens, k, hidden, experts = 8192, 2, 2048, 8
    ids = torch.randint(0, experts, (tokens * k,), device="cuda", dtype=torch.int8)
    wide = ids.long()
    out.append({"op": "sort int8 ids, stable", "elements": ids.numel(),
                "us": per_call_us(lambda: torch.sort(ids, stable=True), 50)})  # fmt: skip
    out.append({"op": "argsort int64 ids, stable", "elements": wide.numel(),
                "us": per_call_us(lambda: torch.argsort(wide, stable=True), 50)})  # fmt: skip
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(tokens * k, device="cuda") // k
    moved = 2 * tokens * k * hidden * 2  # read and written, bf16
    us = per_call_us(lambda: x.index_select(0, slots), 50)
    out.append({"op": "index_select 16,384 rows of 2048 bf16", "bytes_moved": moved, "us": us,
                "gb_s": moved / us / 1e3})  # fmt: skip
    routed = torch.randn(tokens * k, hidden, device="cuda")
    owners = torch.arange(tokens * k, device="cuda") // k
    total = torch.zeros(tokens, hidden, device="cuda")
    moved = tokens * k * hidden * 4 + 2 * tokens * hidden * 4
    us = per_call_us(lambda: total.index_add_(0, owners, routed), 50)
    out.append({"op": "index_add_ 16,384 fp32 rows of 2048 into 8,192", "bytes_moved": moved,
                "us": us, "gb_s": moved / us / 1e3})  # fmt: skip
    out.append(
        {"op": "cumsum of 8 int64", "us": per_call_us(lambda: torch.cumsum(wide[:8], 0), 200)}
    )
    xf = torch.randn(tokens, hidden, device="cuda")
    weight = torch.randn(experts, hidden, device="cuda")
    grad = torch.randn(tokens, experts, device="cuda")
    flops = 2 * tokens * hidden * experts
    for name, fn in (
        ("router forward, fp32", lambda: xf @ weight.t()),
        ("router input gradient, fp32", lambda: grad @ weight),
        ("router weight gradient, fp32", lambda: grad.t() @ xf),
    ):
        us = per_call_us(fn, 50)
        out.append({"op": name, "flops": flops, "us": us, "tflop_s": flops / us / 1e6})
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        us = per_call_us(lambda: xf @ weight.t(), 50)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    out.append(
        {"op": "router forward, TF32", "flops": flops, "us": us, "tflop_s": flops / us / 1e6}
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="kernel_costs")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: kernel_costs.py times CUDA graphs and needs a GPU", file=sys.stderr)
        sys.exit(2)
    results = rows()
    for row in results:
        print(row)
    print("wrote", write_json(args.out, args.name, {"results": results}))


if __name__ == "__main__":
    main()
