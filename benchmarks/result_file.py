"""What every result file under benchmarks/results records about the run that made it, so that
a number can be traced to the code it measured: the date, the commit, the command, the device,
mega's, torch's and Python's versions. The scripts here import it as a sibling (``python
benchmarks/<script>.py`` and torchrun put a script's directory first on the import path)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def commit() -> str | None:
    """The commit measured: ``MEGA_BENCH_COMMIT`` (a copy of the tree without its .git, as on a
    lent GPU machine), else ``git rev-parse HEAD`` with ``+dirty`` when the tree has changes."""
    if os.environ.get("MEGA_BENCH_COMMIT"):
        return os.environ["MEGA_BENCH_COMMIT"]
    here = Path(__file__).parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True
        )
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance() -> dict[str, Any]:
    """The date, commit, command, device (``cpu`` without CUDA), GPU count and versions."""
    import torch

    try:
        from mega import __version__
    except ImportError:  # a driver of other trees (ab_trees.py) started where mega is not on
        __version__ = None  # the path: its rows (each tree's own) must not be lost for this
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count(),
        "versions": {"mega": __version__, "torch": torch.__version__},
        "python": platform.python_version(),
    }


def with_provenance(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with :func:`provenance`'s fields added where it has none of its own (a script
    that records its own date or versions keeps them)."""
    ours = provenance()
    out = {**ours, **result}
    if isinstance(result.get("versions"), dict):  # a script's versions of other packages
        out["versions"] = {**ours["versions"], **result["versions"]}
    return out


def write_json(out: Path, name: str, fields: dict) -> Path:
    """``out/<name>_<date>.json``: :func:`provenance`, then ``fields``. ``out`` is made if
    missing (a run's numbers must not be lost to a folder not yet there)."""
    result = {**provenance(), **fields}
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"{name}_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
