"""The experts' SwiGLU over the rows their grouped GEMM fills (``mega::swiglu_rows``) against
the activation Inductor generates over every row, forward and backward, on one GPU:

    python benchmarks/swiglu_rows.py [--rows 32768 --ffn 2816 --filled 0.5]

``--rows`` the padded arrival (flex's EP2 arrival of issue 46's MoE at micro-batch 4 by
default), ``--filled`` the share of it the grouped GEMM fills (EP2 with balanced routing: half).
Per side ``--iters`` calls back to back between two CUDA events, the median of five such runs,
after ``--warmup`` (the GPU's time: on 2026-12-01 a synchronize after each call timed the host's
launches instead, 0.860 against 0.893 ms). Writes
``<out>/<name>_<date>.json`` with the commit, command and versions. First measured inside a GPU
test at 85858c0 (2 H200, 2026-11-30): 0.489 ms against Inductor's 0.732 ms."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpu_timing import gpu_ms
from result_file import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--filled", type=float, default=0.5, help="share of rows the GEMM fills")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="swiglu_rows")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if not 0 < args.filled <= 1:
        print(f"error: --filled {args.filled}: must be in (0, 1]", file=sys.stderr)
        sys.exit(2)
    import torch

    if not torch.cuda.is_available():
        print(
            "error: benchmarks/swiglu_rows.py needs a CUDA GPU (its kernels are Triton's)",
            file=sys.stderr,
        )
        sys.exit(2)
    from mega.plugins.models.common.swiglu_rows import swiglu_rows

    hidden = torch.randn(args.rows, 2 * args.ffn, device="cuda").bfloat16().requires_grad_(True)
    grad = torch.randn(args.rows, args.ffn, device="cuda").bfloat16()
    end = torch.tensor([int(args.rows * args.filled)], dtype=torch.int32, device="cuda")

    def activation(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    compiled = torch.compile(activation)

    def forward_backward(fn) -> None:  # noqa: ANN001 - no .grad accumulated between calls
        torch.autograd.grad(fn(), hidden, grad)

    ours = gpu_ms(
        lambda: forward_backward(lambda: swiglu_rows(hidden, end)), args.iters, args.warmup
    )
    inductor = gpu_ms(lambda: forward_backward(lambda: compiled(hidden)), args.iters, args.warmup)
    path = write_json(Path(args.out), args.name, {
        "rows": args.rows, "ffn": args.ffn, "filled_rows": int(end.item()),
        "results": {"swiglu_rows_ms": round(ours, 4), "inductor_every_row_ms": round(inductor, 4)},
    })  # fmt: skip
    print(f"swiglu_rows {ours:.3f} ms, Inductor over every row {inductor:.3f} ms -> {path}")


if __name__ == "__main__":
    main()
