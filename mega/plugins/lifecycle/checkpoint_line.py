"""The console line saying a checkpoint was saved, a built-in plugin on ``checkpoint_saved``:
``saved checkpoint at iteration N to PATH in S s`` (without the time for an ``--async-save``
checkpoint, completed beside training). It runs first (``tryfirst``), before other plugins hear
of the checkpoint. Cheap to import."""

from __future__ import annotations

from typing import Any

from mega import hookimpl


@hookimpl(tryfirst=True)
def checkpoint_saved(path: str, iteration: int, engine: Any, seconds: float | None) -> None:
    took = "" if seconds is None else f" in {seconds:.1f} s"
    engine.display.print(f" saved checkpoint at iteration {iteration:8d} to {path}{took}")
