"""A ``train_step`` wrapper that counts and times steps, and a ``shutdown`` hook that reports them.

At the end of a run (also a failed one) it writes ``example-steps.json`` into the run directory:
``{"steps": N, "mean_step_ms": X}``. The time is host wall-clock time around the step: on a GPU
it includes waiting for the device only where the step itself synchronises.
"""

from __future__ import annotations

import json
import time
import weakref
from pathlib import Path
from typing import Any

from mega import hookimpl

STEPS_FILE = "example-steps.json"

# One tally per engine (a process may run several, e.g. in tests); dropped with the engine.
_tallies: weakref.WeakKeyDictionary[Any, list[float]] = weakref.WeakKeyDictionary()


@hookimpl(wrapper=True)
def train_step(engine: Any, microbatches: list, iteration: int):
    start = time.perf_counter()
    result = yield  # the engine's own train_step (or the next wrapper) runs here
    _tallies.setdefault(engine, []).append(time.perf_counter() - start)
    return result


@hookimpl
def shutdown(engine: Any, exc: BaseException | None) -> None:
    seconds = _tallies.pop(engine, [])
    run_dir = getattr(engine, "run_dir", None)  # set by Engine.setup; be safe if it is not
    if run_dir is None:
        return
    summary = {
        "steps": len(seconds),
        "mean_step_ms": 1000.0 * sum(seconds) / len(seconds) if seconds else 0.0,
        "ok": exc is None,
    }
    (Path(run_dir) / STEPS_FILE).write_text(json.dumps(summary) + "\n")
