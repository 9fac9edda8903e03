"""Multi-GPU layouts of a ~1.3B GPT: tokens/s, TFLOP/s and peak memory per GPU, and bf16 losses
against the one-GPU run (the layout-invariance check in bf16).

    python benchmarks/parallel_layouts.py --layouts tp1dp1,tp2dp1,tp1dp2 --iters 20
    python benchmarks/parallel_layouts.py --layouts tp1dp1,pp2-1f1b,pp2v2-interleaved --gbs 32 \
        --name pipeline_schedules
    python benchmarks/parallel_layouts.py --base tp1dp2 --mbs 1 --gbs 8 --name long_context \
        --layouts tp1dp2,cp2:--cp-comm-type=p2p,cp2:--cp-comm-type=all_gather,cp2:--cp-comm-type=a2a \
        --model-flags "--seq-length 32768 --max-position-embeddings 32768"

Each layout is one real ``mega train --nproc-per-node N`` (NCCL), run in turn on this machine. The
model is Megatron's 1.3B shape (24 layers, hidden 2048, 16 heads, seq 2048) in bf16 with fp32
master weights and gradients, the distributed optimizer and overlapped gradient reduction, dropout
off, mock data, and a vocabulary (NullTokenizer, 50176 = 98 x 512 ids) that every TP size up to 4
pads to the same size, so all layouts train the same model on the same batches.

With ``--fake-world`` each layout runs as its rank 0 alone on one GPU, over torch's fake process
group (``benchmarks/fake_rank.py``): no communication, so the step time is one rank's compute,
what a layout costs beside its collectives, measured without the GPUs it needs.

Speed is the median over the iterations after ``--warmup``. Writes
``benchmarks/results/parallel_layouts_<date>.json`` with the commands, versions and numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from result_file import commit, write_json  # noqa: F401  (re-exported: other scripts import them here)

WARMUP_ITERS = 4  # the learning rate's, in every layout's command
MODEL = [
    "--model", "gpt", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "2048", "--max-position-embeddings", "2048",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50175",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
    "--lr", "1e-4", "--lr-warmup-iters", str(WARMUP_ITERS), "--eval-iters", "0",
    "--log-interval", "1",
    "--use-distributed-optimizer", "--overlap-grad-reduce",
]  # fmt: skip


TOKEN = re.compile(
    r"-?(?:(tp|dp|pp|cp|ep|v|mb|first|last)(\d+)|(sp)|(gpipe|1f1b-zb|1f1b|interleaved-zb|interleaved))"
)
FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "v": "--virtual-pipeline-model-parallel-size",
    "mb": "--micro-batch-size",
    "first": "--decoder-first-pipeline-num-layers",
    "last": "--decoder-last-pipeline-num-layers",
}


def layout_env(name: str) -> tuple[str, dict[str, str]]:
    """``cp4@MEGA_CP_RING_GRAPHS=1`` -> (``cp4``, that environment variable): each ``@NAME=VALUE``
    (``cp4@A=1@B=2`` sets two; a comma already separates layouts) is set for that layout's run
    alone, so an A/B of an environment switch runs in one invocation, against the same base."""
    name, _, settings = name.partition("@")
    env = {}
    for setting in filter(None, settings.split("@")):
        key, equals, value = setting.partition("=")
        if not equals or not key:
            raise SystemExit(f"layout '{name}@{settings}': '{setting}' is not NAME=VALUE")
        env[key] = value
    return name, env


def layout_flags(name: str, mbs: int) -> tuple[int, list[str]]:
    """``tp2dp1`` -> (world size 2, the flags). Parts: ``tp<N>``, ``dp<N>``, ``pp<N>``, ``cp<N>``
    (context parallel), ``ep<N>`` (expert parallel: within the data-parallel ranks, so ``ep2dp2``
    is 2 ranks), ``v<N>`` (virtual stages per pipeline rank), a schedule (``gpipe``, ``1f1b``,
    ``interleaved``, ``-zb``), ``sp`` (--sequence-parallel), ``mb<K>`` (micro-batch size: on
    tp1dp1 mb2 is the bf16 noise floor, same math, other kernels), ``first<L>``/``last<L>``
    (uneven pipeline split); e.g. ``pp2v2-interleaved-first14``. Anything after ``:`` is passed
    as flags, space-separated: ``pp2-interleaved:--pipeline-model-parallel-layout=Et*7|t*6|t*6|t*5L``.
    Environment variables for one layout follow ``@`` (:func:`layout_env`)."""
    name, _, extra = name.partition(":")
    parts, sizes, flags = TOKEN.findall(name), {"tp": 1, "dp": 1, "pp": 1, "cp": 1}, []
    if not parts or "".join(TOKEN.sub("", name)):
        raise SystemExit(
            f"layout '{name}' is not made of tp/dp/pp/cp/ep/v/mb/first/last<N>, sp, a schedule"
        )
    values = {key: value for key, value, _, _ in parts if key}
    sizes.update({k: int(v) for k, v in values.items() if k in sizes})
    values.setdefault("mb", str(mbs))
    flags = [arg for key, value in values.items() if key in FLAGS for arg in (FLAGS[key], value)]
    flags += ["--sequence-parallel"] * any(sp for _, _, sp, _ in parts)
    flags += [arg for *_, schedule in parts if schedule for arg in ("--parallel", schedule)]
    return sizes["tp"] * sizes["dp"] * sizes["pp"] * sizes["cp"], flags + extra.split()


def train(
    command: list[str], run_dir: Path, log: Path, env: dict | None = None
) -> tuple[dict, list[dict], str]:
    """One ``mega train`` command (its output kept in ``log``): its row so far (the command, the
    wall time, the error line if it failed), its iteration records (none when it failed) and its
    stdout."""
    shutil.rmtree(run_dir, ignore_errors=True)  # mega appends to an existing metrics.jsonl
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    row: dict = {"command": " ".join(command[1:])}
    row["wall_s"] = round(time.perf_counter() - started, 1)
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode:
        row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return row, [], proc.stdout
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"lm_loss"' in line
    ]
    return row, records, proc.stdout


def speed_and_memory(records: list[dict], warmup: int, world: int) -> dict:
    """Medians over the records after the run's first ``warmup`` iterations, and peak memory
    (the largest over all ranks, and each rank's at the end)."""
    first = records[0]["iteration"]
    timed = [r for r in records if r["iteration"] >= first + warmup]
    tokens = round(statistics.median(r["tokens_per_s"] for r in timed))
    out = {
        "tokens_per_s": tokens,
        "tokens_per_s_per_gpu": round(tokens / world),
        "tflops_per_gpu": round(statistics.median(r["tflops_per_gpu"] for r in timed), 3),
        "step_ms": round(statistics.median(r["elapsed_ms"] for r in timed), 1),
        "max_memory_gb_per_gpu": round(max(r.get("max_memory_gb", 0.0) for r in records), 2),
    }
    if "max_memory_gb_by_rank" in records[-1]:  # pipeline stages differ
        out["peak_memory_gib_by_rank"] = records[-1]["max_memory_gb_by_rank"]
    return out


def run_layout(name: str, args: argparse.Namespace, out: Path) -> dict:
    layout, settings = layout_env(name)
    world, flags = layout_flags(layout, args.mbs)
    run_dir = out / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    runner = [str(Path(__file__).with_name("fake_rank.py"))] if args.fake_world else ["-m", "mega"]
    command = [
        sys.executable, *runner, "train", *MODEL, *flags,
        "--nproc-per-node", str(world),
        "--global-batch-size", str(args.gbs),
        "--train-iters", str(args.iters), "--run-dir", str(run_dir),
        *args.model_flags.split(),
    ]  # fmt: skip
    timing = run_dir / "pipeline_timing"
    env = {**os.environ, **settings}
    if "--parallel" in flags:
        env["MEGA_PIPELINE_TIMING"] = str(timing)
    if args.fake_world:
        env["WORLD_SIZE"] = str(world)
    ran, records, _ = train(command, run_dir, out / f"{run_dir.name}.log", env)
    row: dict = {"layout": name, "world_size": world, "fake_world": args.fake_world, **ran}
    if settings:
        row["env"] = settings
    if not records:
        return row
    row["lm_loss"] = [r["lm_loss"] for r in records]
    row["iterations"] = [r["iteration"] for r in records]  # which steps logged (--log-interval)
    # each step's gradient norm: a layout whose losses part from the base's shows whether its
    # gradients did first (the norm is on the step's line, before the update)
    row["grad_norm"] = [r.get("grad_norm") for r in records]
    row.update(speed_and_memory(records, args.warmup, world))
    if timing.is_dir():
        row["pipeline"] = pipeline_bubbles(timing, flags, args)
    return row


def pipeline_bubbles(timing: Path, flags: list[str], args: argparse.Namespace) -> dict:
    """Measured bubble per rank (1 - compute busy time / span of the schedule, medians over the
    timed steps) against the simulator's bubble for the same table with the measured mean
    forward and backward time per chunk."""
    from mega.core.plugins.manager import make_plugins
    from mega.parallel.pipeline.schedules import schedule_spec
    from mega.parallel.pipeline.simulator import simulate

    ranks = []
    for path in sorted(timing.glob("rank*.jsonl")):
        steps = [json.loads(line) for line in path.read_text().splitlines()][args.warmup :]
        # a split-off weight gradient counts as part of its backward
        backward = [s["backward_ms"] + s.get("weight_grad_ms", 0.0) for s in steps]
        busy = [s["forward_ms"] + b for s, b in zip(steps, backward, strict=True)]
        ranks.append(
            {
                "span_ms": statistics.median(s["span_ms"] for s in steps),
                "busy_ms": statistics.median(busy),
                "bubble": statistics.median(
                    1 - b / s["span_ms"] for b, s in zip(busy, steps, strict=True)
                ),
                "forward_ms": statistics.median(s["forward_ms"] / s["forwards"] for s in steps),
                "backward_ms": statistics.median(
                    b / s["backwards"] for s, b in zip(steps, backward, strict=True)
                ),
                "weight_grad_share": statistics.median(
                    s.get("weight_grad_ms", 0.0) / b for s, b in zip(steps, backward, strict=True)
                ),
            }
        )
    value = dict(zip(flags, flags[1:], strict=False))  # flag -> the token after it
    pp = int(value["--pipeline-model-parallel-size"])
    m = args.gbs // int(value["--micro-batch-size"])  # one data-parallel replica
    first = json.loads((timing / "rank0.jsonl").read_text().splitlines()[0])
    vpp = first["forwards"] // m  # rank 0 runs m forwards per chunk
    forward = statistics.mean(r["forward_ms"] for r in ranks)
    backward = statistics.mean(r["backward_ms"] for r in ranks)
    spec = schedule_spec(make_plugins(), value["--parallel"])
    share = statistics.mean(r["weight_grad_share"] for r in ranks) or 0.5  # used only if split
    simulated = simulate(
        spec.table(pp, vpp, m), pp, vpp, m, forward, backward, "rendezvous", min(share, 0.99)
    )
    return {
        "ranks": [{k: round(v, 4) for k, v in r.items()} for r in ranks],
        "measured_bubble_mean": round(statistics.mean(r["bubble"] for r in ranks), 4),
        "simulated_bubble": round(simulated.bubble_fraction, 4),
        "analytic_bubble_unit_costs": spec.analytic_bubble(pp, vpp, m),
    }


def write_result(rows: list[dict], args: argparse.Namespace, out: Path) -> Path:
    """The result file of the layouts run so far, each compared with ``--base``."""
    base = next((r for r in rows if r["layout"] == args.base and "lm_loss" in r), None)
    for row in rows:
        if base is not None and "lm_loss" in row and row is not base:
            # the iterations both logged: a layout may set its own --log-interval (its line's
            # loss is then the mean over its interval, as Megatron's)
            ours = dict(zip(row["iterations"], row["lm_loss"], strict=True))
            theirs = dict(zip(base["iterations"], base["lm_loss"], strict=True))
            row[f"max_rel_loss_diff_vs_{args.base}"] = max(
                abs(ours[i] - theirs[i]) / abs(theirs[i]) for i in ours.keys() & theirs.keys()
            )
            row[f"per_gpu_vs_{args.base}"] = round(
                row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 4
            )
    return write_json(out, args.name, {"results": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="tp1dp1,tp2dp1,tp1dp2")
    parser.add_argument("--name", default="parallel_layouts", help="result file name prefix")
    parser.add_argument("--base", default="tp1dp1", help="the layout the others are compared to")
    parser.add_argument("--iters", type=int, default=20, help="training iterations in all")
    parser.add_argument("--warmup", type=int, default=5, help="of them, not timed")
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument(
        "--model-flags",
        default="",
        help="mega train flags appended to every layout's command (they override the 1.3B "
        "model's, e.g. a small model with --device cpu for a gloo run)",
    )
    parser.add_argument(
        "--fake-world",
        action="store_true",
        help="run each layout's rank 0 alone on one GPU over a fake process group (compute only)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if not args.warmup < args.iters:
        parser.error(f"--warmup {args.warmup} leaves none of --iters {args.iters} to time")
    if args.iters <= WARMUP_ITERS:  # mega train's own refusal, once per layout otherwise
        parser.error(f"--iters {args.iters} must exceed the runs' --lr-warmup-iters {WARMUP_ITERS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in args.layouts.split(","):
        rows.append(run_layout(name, args, out))
        path = write_result(rows, args, out)  # after each layout: a cut-off run keeps the rest
    for row in rows:
        print(
            json.dumps(
                {
                    k: v
                    for k, v in row.items()
                    if k not in ("lm_loss", "grad_norm", "command", "iterations")
                }
            )
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
