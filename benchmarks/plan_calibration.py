"""This GPU's rates for ``mega plan`` (``mega.core.plan.calibration.measure_rates``: GEMMs in
bf16 and FP8, fused attention, memory bandwidth, host time per op), as a dated result file: the
source of the planner's built-in table.

    python benchmarks/plan_calibration.py --name plan_calibration_h100

Writes ``benchmarks/results/<name>_<date>.json`` (or under ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="plan_calibration")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("plan_calibration.py measures a GPU, and this machine has none")
    from mega.core.plan.calibration import measure_rates

    start = time.perf_counter()
    rates = measure_rates()
    seconds = time.perf_counter() - start
    props = torch.cuda.get_device_properties(0)
    from result_file import with_provenance  # the date, commit, device, versions

    result = with_provenance(
        {
            "date": datetime.date.today().isoformat(),
            "command": " ".join([sys.executable, *sys.argv]),
            "device": f"{props.name}, {props.total_memory // 2**20} MiB",
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
            "seconds": round(seconds, 1),
            "rates": dataclasses.asdict(rates),
        }
    )
    path = Path(args.out) / f"{args.name}_{result['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
