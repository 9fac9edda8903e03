"""A GEMM beside a kernel that holds some SMs, with and without torch's SM carve-out, on one GPU:

    python benchmarks/sm_contention.py [--ctas 24 --carveouts 24,32]

Why: in a profile of issue 46's MoE at DP2 on 2 H200 (2026-12-01) the second micro-batch's
backward grouped GEMMs ran 1.6-1.8x slower beside the gradient reduce-scatters (NCCL, 24 CTAs):
a GEMM that launches one CTA per SM finds some SMs taken and runs the rest in a second wave.
Here a spinning Triton kernel of ``--ctas`` CTAs (1,024 threads each) on a side stream stands in
for NCCL's. Rows: the experts' grouped GEMM (``torch._grouped_mm``, 16,384 rows over 8 experts,
2048 -> 5632) and a dense bf16 GEMM (8192 x 2048 x 8192), each alone, beside the spinner, and
beside it with ``torch._C._set_sm_carveout_experimental(c)`` for each ``c`` of ``--carveouts``
(and alone with the first), with the grid each kernel launched. Per row the median of
``--reps`` timings of three calls back to back. Writes ``<out>/<name>_<date>.json``."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from result_file import write_json


def _spinner():  # noqa: ANN202
    import triton
    import triton.language as tl

    @triton.jit
    def spin(x, n):
        at = tl.program_id(0) * 1024 + tl.arange(0, 1024)
        acc = tl.load(x + at)
        for _ in range(n):
            acc = acc * 0.9999 + 1.0
        tl.store(x + at, acc)

    return spin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctas", type=int, default=24, help="CTAs of the kernel beside")
    parser.add_argument("--carveouts", default="24,32", help="SMs carved out, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--name", default="sm_contention")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    try:
        carveouts = [int(c) for c in args.carveouts.split(",")]
    except ValueError:
        carveouts = []
    if not carveouts or min(carveouts) < 1 or not 0 < args.ctas <= 128:
        print(f"error: --ctas {args.ctas} (1-128) and --carveouts {args.carveouts!r} (positive"
              " SM counts, comma-separated)", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/sm_contention.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    spin = _spinner()
    experts, hidden, ffn, rows = 8, 2048, 5632, 16384
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, ffn, hidden, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
    gemms = {
        "grouped": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets),
        "dense": lambda: a @ b,
    }
    scratch = torch.zeros(args.ctas * 1024, device="cuda")
    side = torch.cuda.Stream()

    def timed(gemm, beside: bool, carveout: int | None) -> float:  # noqa: ANN001
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            gemm()
            torch.cuda.synchronize()
            runs = []
            for _ in range(args.reps):
                if beside:  # ~1 s of spinning: it outlasts the three calls
                    with torch.cuda.stream(side):
                        spin[(args.ctas,)](scratch, 200_000, num_warps=32)
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    gemm()
                stop.record()
                torch.cuda.synchronize()
                runs.append(start.elapsed_time(stop) / 3)
            return statistics.median(runs)
        finally:
            torch._C._set_sm_carveout_experimental(None)

    def launched(gemm, carveout: int | None) -> dict:  # noqa: ANN001
        """The name and grid of the GEMM's longest kernel (the carve-out shows in its grid)."""
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                gemm()
                torch.cuda.synchronize()
        finally:
            torch._C._set_sm_carveout_experimental(None)
        with tempfile.TemporaryDirectory() as scratch_dir:
            trace = Path(scratch_dir) / "trace.json"
            p.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        kernels = [e for e in events if e.get("cat") == "kernel"]
        longest = max(kernels, key=lambda e: e["dur"])
        return {"kernel": longest["name"][:60], "grid": longest["args"].get("grid")}

    cases = [(False, None), (True, None)] + [(True, c) for c in carveouts] + [(False, carveouts[0])]
    rows_out = []
    for name, gemm in gemms.items():
        alone = timed(gemm, False, None)
        for beside, carveout in cases:
            ms = alone if (beside, carveout) == (False, None) else timed(gemm, beside, carveout)
            row = {"gemm": name, "beside": beside, "carveout": carveout, "ms": round(ms, 4),
                   "vs_alone": round(ms / alone, 3), **launched(gemm, carveout)}  # fmt: skip
            rows_out.append(row)
            print(row)
    path = write_json(Path(args.out), args.name, {"ctas_beside": args.ctas, "results": rows_out})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
