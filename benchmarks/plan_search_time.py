"""How long `mega plan --search` takes on this machine's CPUs, by `--jobs` (forked processes).

    python benchmarks/plan_search_time.py --gpus 8 --jobs 1 2        # the 6.7B GPT, 8 GPUs
    python benchmarks/plan_search_time.py --gpus 2 --jobs 1 2 --model-flags "..." --name x

Each `--jobs` value runs the same search from the shell (torch's import included) and must print
the same table: a search whose result depended on its processes would be wrong, not faster. The
rows record the wall time, the CPU time of the command and its workers, and the layout shapes
searched (the last progress line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

# the 6.7B GPT of benchmarks/parallel_layouts.py (32 layers, hidden 4096, 32 heads, seq 2048)
GPT_6P7B = (
    "--model gpt --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048"
    " --micro-batch-size 1 --global-batch-size 64 --bf16"
)
SHAPES = re.compile(r"searched (\d+)/(\d+) layout shapes")


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def run_search(flags: list[str], jobs: int) -> dict:
    """One `mega plan FLAGS --search --jobs JOBS`: its wall and CPU seconds, output and shapes."""
    exe = shutil.which("mega") or sys.exit("error: the `mega` console script is not installed")
    command = [exe, "plan", *flags, "--search", "--jobs", str(jobs)]
    cpu, start = _cpu_seconds(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    if done.returncode:
        sys.exit(f"error: {shlex.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    shapes = SHAPES.findall(done.stderr)
    return {
        "jobs": jobs,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "shapes": int(shapes[-1][1]) if shapes else None,
        "stdout": done.stdout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8, help="the searched launch's GPUs")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="--jobs values")
    parser.add_argument("--model-flags", default=GPT_6P7B, help="mega train's flags searched")
    parser.add_argument("--name", default="plan_search_time", help="result file prefix")
    parser.add_argument("--note", default="", help="what the run showed, for the result file")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.gpus < 1 or any(j < 1 for j in args.jobs):
        parser.error("--gpus and every --jobs value must be at least 1")
    flags = [*shlex.split(args.model_flags), "--gpus", str(args.gpus)]
    rows = []
    for jobs in args.jobs:
        row = run_search(flags, jobs)
        print(f"--jobs {jobs}: {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU", flush=True)
        rows.append(row)
    tables = {row.pop("stdout") for row in rows}
    from result_file import with_provenance  # the date, commit, device, versions

    record = with_provenance(
        {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "searched": {"model_flags": args.model_flags, "gpus": args.gpus},
            "same_table": len(tables) == 1,
            "table": sorted(tables)[0],
            "results": rows,
            **({"note": args.note} if args.note else {}),
        }
    )
    path = Path(args.out) / f"{args.name}_{record['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    if len(tables) != 1:
        sys.exit("error: the --jobs values printed different tables")


if __name__ == "__main__":
    main()
