"""What the benchmarks that run mega against Hugging Face models share (BERT, T5, MoE).

Not a benchmark. The optimizer and the training loop every Hugging Face system runs, a dataset
plugin of synthetic samples for mega (registered the way a third-party package would), one
system's run and timing, and the dated result file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpt_throughput import (
    BETAS,
    CLIP,
    EPS,
    LR,
    PEAK_TFLOPS,
    WARMUP,
    WEIGHT_DECAY,
    StepClock,
    fresh_gpu,
    train_mega,
    with_timing,
)

from mega import DatasetSpec, DatasetSplits, hookimpl

# each Hugging Face model eager and compiled, in bf16 parameters or fp32 ones under autocast
HF_SYSTEMS = ("hf-bf16", "hf-bf16-compile", "hf-fp32-autocast", "hf-fp32-autocast-compile")


def hf_adamw(params: list[torch.nn.Parameter], device: str) -> torch.optim.AdamW:
    """mega's AdamW settings for a Hugging Face model: no weight decay on 1-D parameters."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR, betas=BETAS, eps=EPS, fused=device == "cuda",
    )  # fmt: skip


def train_hf(
    model: torch.nn.Module,
    name: str,
    batches: Callable[[int], list[dict[str, torch.Tensor]]],
    args: argparse.Namespace,
    clock: StepClock,
    total_iters: int,
) -> dict:
    """Train ``model`` (fp32, on the device) as system ``name`` (``HF_SYSTEMS``) on
    ``batches(step)``: its own loss (``.loss``), the schedule, clipping and AdamW mega uses.
    Returns the mean loss of the timed steps, the first step's and the parameter count."""
    from mega.core.schedules.learning_rate import LRSchedule

    bf16 = name.startswith("hf-bf16")
    if bf16:
        model = model.to(torch.bfloat16)
    model.train()
    params = list(model.parameters())
    optimizer = hf_adamw(params, args.device)
    forward = torch.compile(model) if name.endswith("-compile") else model
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=not bf16)
    schedule = LRSchedule(
        max_lr=LR, min_lr=0.0, decay_style="constant", decay_iters=total_iters, warmup_iters=WARMUP
    )
    losses = []
    for step in range(total_iters):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        microbatches = batches(step)
        total = torch.zeros((), device=args.device)
        for mb in microbatches:
            with autocast:
                loss = forward(**mb).loss
            (loss / len(microbatches)).backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(microbatches))
        clock.step_done(step + 1)
    timed = slice(args.warmup, args.warmup + args.iters)
    return {
        "loss": float(torch.stack(losses[timed]).mean()),
        "first_loss": float(losses[0]),
        "parameters": sum(p.numel() for p in params),
    }


@dataclass(kw_only=True)
class NoOptions:
    """A synthetic dataset has no options."""


class SyntheticDataset:
    """A plugin registering dataset ``name``: ``samples(ctx)`` gives its train split."""

    def __init__(self, name: str, provides: tuple[str, ...], samples: Callable[[Any], Any]):
        self.name, self.provides, self.samples = name, provides, samples

    @hookimpl
    def register_datasets(self, register: Any) -> None:
        def build(config: Any, request: Any, ctx: Any) -> DatasetSplits:
            return DatasetSplits(train=self.samples(ctx))

        register(
            DatasetSpec(
                name=self.name, config_cls=NoOptions, build=build,
                description="random samples (benchmarks)", provides=self.provides,
            )
        )  # fmt: skip


def run_system(
    name: str,
    args: argparse.Namespace,
    flops: float,
    mega_argv: Callable[[argparse.Namespace, int, int, str], list[str]],
    dataset: SyntheticDataset,
    run_hf: Callable[[argparse.Namespace, StepClock, int, str], dict],
) -> dict:
    """One system's row: ``mega`` (``mega_argv`` with ``dataset`` registered) or a Hugging Face
    one (``run_hf``), timed by the same clock."""
    fresh_gpu()
    cuda = args.device == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else 0
    profile_steps = 3 if args.profile and cuda else 0
    total_iters = args.warmup + args.iters + profile_steps
    clock = StepClock(args.warmup + 1, args.warmup + args.iters, profile_steps, cuda)
    started = time.perf_counter()
    if name.startswith("mega"):  # "mega" or a script's variant of it ("mega-original")
        argv = mega_argv(args, total_iters, math.gcd(args.warmup, args.iters), name)
        argv += shlex.split(args.mega_flags)
        row = train_mega(argv, clock, args.warmup, args.iters, ((dataset.name, dataset),))
        row.pop("flops_per_token")
    else:
        row = run_hf(args, clock, total_iters, name)
    row = {"system": name, **row, "wall_s": round(time.perf_counter() - started, 1)}
    return with_timing(row, clock, args.gbs * args.seq, flops, baseline)


def against_fastest_hf(rows: list[dict]) -> dict:
    """Each mega row against the fastest Hugging Face row: tokens/s and peak memory ratios."""
    hf = [r for r in rows if r["system"].startswith("hf-")]
    if not hf:
        return {}
    fastest = max(hf, key=lambda r: r["tokens_per_s"])
    summary: dict = {"fastest_hf": fastest["system"]}
    for row in rows:
        if row["system"].startswith("mega"):
            peak, fastest_peak = row["peak_memory_gib"], fastest["peak_memory_gib"]
            summary[f"{row['system']} vs {fastest['system']}"] = {
                "tokens_per_s": round(row["tokens_per_s"] / fastest["tokens_per_s"], 4),
                "peak_memory": round(peak / fastest_peak, 4) if peak else None,
            }
    return summary


def write_result(
    name: str, args: argparse.Namespace, rows: list[dict], settings: dict, summary: dict
) -> Path:
    """``<args.out>/<name>_<date>.json`` with the command, device, versions, ``settings``,
    ``summary`` and ``rows``; prints the profiles and the summary."""
    import transformers
    from result_file import with_provenance  # the date, commit, device, versions

    from mega import __version__

    result = with_provenance({
        "date": datetime.date.today().isoformat(),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "versions": {
            "mega": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "settings": {**settings, "peak_tflops": PEAK_TFLOPS},
        "summary": summary,
        "results": rows,
    })  # fmt: skip
    path = Path(args.out) / f"{name}_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        if "profile" in row:
            print(f"--- {row['system']}\n{row['profile']}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return path


def run_all(args: argparse.Namespace, systems: list[str], run: Callable[[str], dict]) -> list[dict]:
    """``run(system)`` for each system in turn, printing each row as it comes."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in systems:
        rows.append(run(name))
        shown = {k: v for k, v in rows[-1].items() if k not in ("argv", "profile")}
        print(json.dumps(shown), flush=True)
    return rows


def checked_systems(
    args: argparse.Namespace,
    script: str,
    hf_systems: tuple[str, ...] = HF_SYSTEMS,
    mega_systems: tuple[str, ...] = ("mega",),
) -> list[str]:
    """``--systems`` as a list, after the checks every script makes."""
    if args.warmup + args.iters <= WARMUP:
        raise SystemExit(f"--warmup + --iters must exceed the {WARMUP} LR warm-up steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU (--device cpu: a smoke run only)")
    systems = args.systems.split(",")
    for name in systems:
        if name not in (*hf_systems, *mega_systems):
            raise SystemExit(f"unknown system '{name}': choose from {hf_systems + mega_systems}")
    return systems


def common_flags(
    parser: argparse.ArgumentParser, mbs: int, mega_systems: tuple[str, ...] = ("mega",)
) -> None:
    """The flags every script shares after its model's."""
    parser.add_argument("--systems", default=",".join((*HF_SYSTEMS, *mega_systems)))
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--mbs", type=int, default=mbs)
    parser.add_argument("--gbs", type=int, default=mbs, help="global batch (samples per step)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument("--profile", action="store_true", help="a kernel table of 3 more steps")
    parser.add_argument(
        "--mega-flags", default="", help="more mega train flags for the mega systems (quoted)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
