"""How long `mega --help` and `mega plugins` take to answer (target: under 0.5 s, no torch).

    python benchmarks/startup_time.py            # 10 runs each, writes benchmarks/results/
    python benchmarks/startup_time.py --runs 20 --name startup_time_after_x

Both paths only discover plugins; neither may import torch, which alone takes 1.5-2.5 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [["--help"], ["plugins"], ["plugins", "--json"]]
TARGET_S = 0.5


def time_command(argv: list[str], runs: int) -> list[float]:
    exe = shutil.which("mega") or sys.exit("the `mega` console script is not installed")
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([exe, *argv], check=True, capture_output=True)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each command")
    parser.add_argument(
        "--name", default="startup_time", help="result file name prefix (<name>_<date>.json)"
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    runs = args.runs
    rows = []
    for argv in COMMANDS:
        samples = time_command(argv, runs)
        rows.append(
            {
                "command": "mega " + " ".join(argv),
                "median_s": round(statistics.median(samples), 4),
                "max_s": round(max(samples), 4),
                "runs": runs,
                "under_target": max(samples) < TARGET_S,
            }
        )
    from importlib.metadata import version

    import rich  # noqa: F401

    today = datetime.date.today().isoformat()
    from result_file import with_provenance  # the date, commit, device, versions

    result = with_provenance(
        {
            "date": today,
            "command": " ".join([sys.executable, *sys.argv]),
            "python": platform.python_version(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "versions": {p: version(p) for p in ("mega", "click", "pluggy", "rich")},
            "target_s": TARGET_S,
            "results": rows,
        }
    )
    out = Path(__file__).parent / "results" / f"{args.name}_{today}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(f"{row['command']:24s} median {row['median_s']:.3f} s  max {row['max_s']:.3f} s")
    print(f"wrote {out}")
    if not all(row["under_target"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
