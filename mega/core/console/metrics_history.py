"""Reading a run's ``metrics.jsonl`` back as one timeline, across restarts (torch-free).

A run that resumes from a checkpoint appends to the same file, after a marker
``{"event": "resume", "iteration": N, ...}``: iterations after N that were logged before the marker
belong to the abandoned stretch (trained again after the restart), so they are dropped, and a
later record for an iteration replaces an earlier one. What is left is what a plot should show:
one record per iteration, in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
RESUME_EVENT = "resume"


@dataclass
class MetricsHistory:
    """Training records (iteration lines), validation and test records, each by iteration."""

    train: dict[int, dict[str, Any]] = field(default_factory=dict)
    valid: dict[int, dict[str, Any]] = field(default_factory=dict)
    test: dict[int, dict[str, Any]] = field(default_factory=dict)
    resumes: list[dict[str, Any]] = field(default_factory=list)  # the markers, in file order

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(iterations, values) of ``key`` in iteration order, from the records that have it."""
        source = {"valid_lm_loss": self.valid, "test_lm_loss": self.test}.get(key, self.train)
        points = sorted((it, rec[key]) for it, rec in source.items() if key in rec)
        return [it for it, _ in points], [float(v) for _, v in points]


def resume_record(iteration: int, **extra: Any) -> dict[str, Any]:
    """The marker a restarted run writes before its first new record."""
    return {"event": RESUME_EVENT, "iteration": int(iteration), **extra}


def read_history(path: str | Path) -> MetricsHistory:
    """Parse ``metrics.jsonl`` (or a run directory holding one), honouring resume markers.
    A line that is not JSON (a crash mid-write) is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    history = MetricsHistory()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or "iteration" not in record:
            continue
        iteration = int(record["iteration"])
        if record.get("event") == RESUME_EVENT:
            history.resumes.append(record)
            for table in (history.train, history.valid, history.test):
                for stale in [it for it in table if it > iteration]:
                    del table[stale]
            continue
        if "event" in record:  # a marker of a kind this reader does not know
            continue
        if "valid_lm_loss" in record:
            table = history.valid
        elif "test_lm_loss" in record:
            table = history.test
        else:
            table = history.train
        table[iteration] = record
    return history
