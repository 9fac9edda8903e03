"""A MoE GPT trained at one expert-parallel layout, saved, and continued at another: the losses
after the reshard against the uninterrupted run, with the speed, memory, router and checkpoint
numbers of both.

    python benchmarks/moe_scale_run.py --first ep4tp2dp4-sp --then ep2tp2dp2-sp     # 8 -> 4 GPUs
    python benchmarks/moe_scale_run.py --first ep2dp2 --then tp2-sp                 # 2 GPUs
    python benchmarks/moe_scale_run.py --first ep4tp2dp4-sp --then ep2tp2dp2-sp --name \\
        moe_scale_run_cpu --dtype fp32 --bound 1e-5 --mbs 1 --gbs 8 --model-flags "--num-layers 2 \\
        --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --moe-ffn-hidden-size 96 \\
        --seq-length 64 --max-position-embeddings 64 --vocab-size 511 --device cpu"  # 8 CPU ranks

The sequence, each step a real ``mega train --nproc-per-node N``, in turn:

1. ``--first``: ``--iters`` iterations from scratch, a zarr checkpoint saved at ``--save-at``
   (and, as every ``--save`` run does, at the end);
2. ``--then``: ``--load`` of the iteration-``--save-at`` checkpoint at another layout (the
   experts, tensor-parallel shards and distributed-optimizer shards reshard on load), on to
   ``--iters``;
3. ``--reference`` (optional, e.g. ``tp1dp1``: one process): uninterrupted to ``--iters``.

Layouts are ``benchmarks/parallel_layouts.py``'s names plus ``ep<N>`` (expert-parallel size,
within the data-parallel ranks: ``ep4tp2dp4`` is 8 ranks). The model (defaults) is a Mixtral-like
GPT: 12 layers, hidden 2048, 16 heads in 8 query groups, RoPE, RMSNorm, SwiGLU, untied, no
biases, every MLP 8 experts of ffn 4096 with top-2 routing (dropless) and a load-balancing loss
(1e-2), the grouped GEMM and the all-to-all dispatcher, seq 4096, vocab 32000, bf16 with fp32
masters (``--dtype``), the distributed optimizer, mock data: about 2.7B parameters, 0.8B active per token.
``--model-flags`` overrides any of it.

Per run: wall time, median tokens/s and TFLOP/s per GPU (mega's FLOPs per token: the active
parameters) over the iterations after ``--warmup``, peak memory per rank, the router's
load-balancing loss and dropped-token share, save and load seconds (from ``mega train``'s own
lines) and the checkpoint's bytes. The checks: the largest relative difference of the per-iteration
losses after ``--save-at`` between the two runs (and of every iteration's between the first run
and the reference), against ``--bound`` (default 1e-2, the bf16
bound of ``tests/test_gpu_parallel.py``; fp32 on CPUs holds 1e-5). Writes
``benchmarks/results/<name>_<date>.json`` with the commands, versions and numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

from parallel_layouts import (
    layout_flags,
    speed_and_memory,
    train,
    write_json,
)

MODEL = [
    "--model", "moe", "--num-layers", "12", "--hidden-size", "2048",
    "--num-attention-heads", "16", "--num-query-groups", "8",
    "--num-experts", "8", "--moe-ffn-hidden-size", "4096", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--seq-length", "4096", "--max-position-embeddings", "4096",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
    "--lr", "1e-4", "--lr-warmup-iters", "5", "--eval-iters", "0", "--log-interval", "1",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--ckpt-format", "zarr",
]  # fmt: skip
SAVED = re.compile(r"saved checkpoint at iteration\s+(\d+) to \S+ in ([\d.]+) s")
LOADED = re.compile(r"loaded checkpoint \S+ at iteration (\d+) in ([\d.]+) s")


def run(name: str, layout: str, flags: list[str], args: argparse.Namespace, out: Path) -> dict:
    """One ``mega train`` of ``layout`` with ``flags`` (save or load) added: its row."""
    world, layout_args = layout_flags(layout, args.mbs)
    run_dir = out / name
    command = [
        sys.executable, "-m", "mega", "train", *MODEL, *layout_args, *flags,
        *(["--bf16"] if args.dtype == "bf16" else []),
        "--nproc-per-node", str(world), "--global-batch-size", str(args.gbs),
        "--train-iters", str(args.iters), "--run-dir", str(run_dir), *args.model_flags.split(),
    ]  # fmt: skip
    ran, records, stdout = train(command, run_dir, out / f"{name}.log")
    row: dict = {"run": name, "layout": layout, "world_size": world, **ran}
    if not records:
        return row
    row["lm_loss"] = {r["iteration"]: r["lm_loss"] for r in records}
    row["grad_norm"] = {r["iteration"]: r["grad_norm"] for r in records if "grad_norm" in r}
    row.update(speed_and_memory(records, args.warmup, world))
    for key in ("load_balancing_loss", "dropped_token_fraction"):
        values = [r[key] for r in records if key in r]
        if values:
            row[key] = {"first": values[0], "last": values[-1], "mean": statistics.mean(values)}
    row["saves"] = [{"iteration": int(i), "s": float(s)} for i, s in SAVED.findall(stdout)]
    row["loads"] = [{"iteration": int(i), "s": float(s)} for i, s in LOADED.findall(stdout)]
    return row


def max_rel(values: dict[int, float], against: dict[int, float], iterations: list[int]) -> float:
    return max(abs(values[i] - against[i]) / abs(against[i]) for i in iterations)


def compare(row: dict, against: dict, iterations: list[int], bound: float) -> dict:
    """The largest relative differences of ``row``'s losses (checked against ``bound``) and
    gradient norms (reported: a gradient shows a difference a step before the loss does) from
    ``against``'s over ``iterations``."""
    loss = max_rel(row["lm_loss"], against["lm_loss"], iterations)
    return {
        "iterations": [min(iterations), max(iterations)],
        "max_rel_loss_diff": loss,
        "max_rel_grad_norm_diff": max_rel(row["grad_norm"], against["grad_norm"], iterations),
        "bound": bound,
        "within_bound": loss <= bound,
    }


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", default="ep2dp2", help="the layout that trains and saves")
    parser.add_argument("--then", default="tp2-sp", help="the layout that loads and continues")
    parser.add_argument(
        "--reference",
        default=None,
        help="a layout (e.g. tp1dp1: one process) trained uninterrupted to --iters, which the "
        "first run's losses are checked against too",
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--save-at", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="iterations after each start")
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--bound", type=float, default=1e-2)
    parser.add_argument("--model-flags", default="", help="mega train flags added to the model's")
    parser.add_argument("--name", default="moe_scale_run", help="result file name prefix")
    parser.add_argument("--ckpt-dir", default=None, help="default: <out>/ckpt")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if not 0 < args.save_at < args.iters:
        raise SystemExit(f"--save-at {args.save_at}: must lie between 0 and --iters {args.iters}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt_dir or out / "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    save = ["--save", str(ckpt), "--save-interval", str(args.save_at)]
    first = run("first", args.first, save, args, out)
    rows, check = [first], {}
    saved = ckpt / f"iter_{args.save_at:07d}"
    if "error" not in first:
        first["checkpoint_bytes"] = checkpoint_bytes(saved)
        then = run("then", args.then, ["--load", str(saved)], args, out)
        rows.append(then)
        if "error" not in then:
            after = [i for i in then["lm_loss"] if i > args.save_at]
            check["then_vs_first"] = compare(then, first, after, args.bound)
    if args.reference and "error" not in first:
        reference = run("reference", args.reference, [], args, out)
        rows.append(reference)
        if "error" not in reference:
            every = sorted(first["lm_loss"])
            check["first_vs_reference"] = compare(first, reference, every, args.bound)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "ckpt_dir")}
    path = write_json(out, args.name, {"settings": settings, "check": check, "results": rows})
    for row in rows:
        print(
            json.dumps(
                {k: v for k, v in row.items() if k not in ("lm_loss", "grad_norm", "command")}
            )
        )
    print(json.dumps(check))
    print(f"wrote {path}")
    expected = 1 + bool(args.reference)
    if len(check) < expected or not all(c["within_bound"] for c in check.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
