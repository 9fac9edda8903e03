"""The gradient buffer's fp32 accumulation (``mega.parallel.data.accumulate``) against torch's
``copy_``/``add_`` of the same bf16 gradient into fp32, on one GPU:

    python benchmarks/grad_accumulation.py [--sizes 4194304,8388608,16777216,46137344,92274688]

For each size (elements; the defaults bracket the Triton kernel's threshold and end at issue 46's
MoE expert weights, fc2 and fc1 of 8 experts) the GPU's time of one call each way
(``gpu_ms``: ``--iters`` calls back to back, the median of five runs) and the bytes per second
it moved (copy: 2 read + 4 written per element; add: 2 + 4 read + 4 written). Writes
``<out>/<name>_<date>.json`` with the commit, command and versions."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpu_timing import gpu_ms
from result_file import write_json


def _timings(main_grad, grad, iters: int, warmup: int) -> dict:  # noqa: ANN001
    """Milliseconds and TB/s of the copy and the add, ours and torch's."""
    from mega.parallel.data.accumulate import accumulate_into

    n, row = grad.numel(), {}
    ways = {
        "copy": (
            6 * n,
            lambda: accumulate_into(main_grad, grad, True),
            lambda: main_grad.copy_(grad),
        ),
        "add": (
            10 * n,
            lambda: accumulate_into(main_grad, grad, False),
            lambda: main_grad.add_(grad),
        ),
    }
    for kind, (moved, ours, theirs) in ways.items():
        for name, step in ((kind, ours), (f"torch_{kind}", theirs)):
            ms = gpu_ms(step, iters, warmup)
            row[f"{name}_ms"], row[f"{name}_tb_per_s"] = round(ms, 4), round(moved / ms / 1e9, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4194304,8388608,16777216,46137344,92274688")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="grad_accumulation")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        print(f"error: --sizes {args.sizes!r}: positive element counts, comma-separated",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/grad_accumulation.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    from mega.parallel.data.accumulate import takes_triton

    rows = []
    for n in sizes:
        main_grad = torch.zeros(n, device="cuda")
        grad = torch.randn(n, device="cuda").bfloat16()
        row = {"elements": n, "triton": takes_triton(main_grad, grad)}
        row.update(_timings(main_grad, grad, args.iters, args.warmup))
        rows.append(row)
        print(row)
    path = write_json(Path(args.out), args.name, {"results": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
