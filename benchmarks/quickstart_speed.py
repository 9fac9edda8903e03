"""CPU speed of the README's quickstart run: `mega train --model gpt` (the embedded English
text, the default small GPT), timed from its own iteration lines.

    python benchmarks/quickstart_speed.py --iters 40

Runs the installed `mega` console script, takes the mean "elapsed time per iteration" of the
lines after iteration 10 (the first lines include start-up work), and writes
``benchmarks/results/quickstart_speed_<date>.json`` (or ``--out``/``--name``) with the command,
versions, the step time, tokens/s and the last printed loss. benchmarks/ab_trees.py can compare
two trees with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LINE = re.compile(r"iteration\s+(\d+)/.*?global batch size:\s+(\d+) \| lm loss: ([0-9.E+-]+)")
SEQ_LENGTH = 128  # the quickstart's default --seq-length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--name", default="quickstart_speed")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    exe = shutil.which("mega") or sys.exit("the `mega` console script is not installed")
    with tempfile.TemporaryDirectory() as run_dir:
        command = [exe, "train", "--model", "gpt", "--train-iters", str(args.iters)]
        command += ["--log-interval", "10", "--eval-iters", "0", "--run-dir", run_dir]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    lines = LINE.findall(out)
    step_ms = statistics.mean(float(x) for x in ELAPSED.findall(out)[2:])
    gbs = int(lines[-1][1])
    row = {
        "system": "quickstart",
        "step_ms": round(step_ms, 2),
        "tokens_per_s": round(gbs * SEQ_LENGTH / (step_ms / 1000.0), 1),
        "last_iteration": int(lines[-1][0]),
        "lm_loss": lines[-1][2],
    }
    print(json.dumps(row))
    import torch
    from result_file import with_provenance  # the date, commit, device, versions

    record = with_provenance(
        {
            "date": datetime.date.today().isoformat(),
            "command": shlex.join(command[:1] + command[1:-2]),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "results": [row],
        }
    )
    path = Path(args.out) / f"{args.name}_{record['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
