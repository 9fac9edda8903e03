"""Refuse to train into a directory that already holds another run.

``mega train --config runs/a/config.resolved.toml`` repeats run ``a`` with its ``--save runs/a``:
without this check it would overwrite ``a``'s checkpoints and append to its ``metrics.jsonl``.
A directory holds a run when it has a complete checkpoint or a non-empty ``metrics.jsonl``.
Continuing is allowed: ``--load D --save D`` (the auto-resume pattern, also on its first run) and
any ``--load`` with ``--run-dir`` (the metrics get a resume marker). Torch-free, so the refusal comes
before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega.core.checkpoint.store import find_checkpoint

METRICS_FILE = "metrics.jsonl"


def _same(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _loads_from(load: str | None, directory: str) -> bool:
    """Whether ``--load`` names ``directory`` (its root or one of its ``iter_*`` directories)."""
    if not load:
        return False
    load_path = Path(load)
    return _same(load_path, directory) or (
        load_path.name.startswith("iter_") and _same(load_path.parent, directory)
    )


def checkpoint_iteration(path: str | Path) -> int | None:
    """The iteration of an ``iter_0000100`` directory (None for another name)."""
    name = Path(path).name
    digits = name.removeprefix("iter_")
    return int(digits) if digits != name and digits.isdigit() else None


def what_it_holds(directory: str | Path) -> str | None:
    """``"a checkpoint at iteration 500"`` / ``"metrics.jsonl"``, or None for no run there."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    checkpoint = find_checkpoint(directory)
    if checkpoint is not None:
        iteration = checkpoint_iteration(checkpoint)
        return "a checkpoint" + (f" at iteration {iteration}" if iteration is not None else "")
    metrics = directory / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        return f"a run's {METRICS_FILE}"
    return None


def existing_run_problems(config: Any) -> list[str]:
    """One line per directory this run would write into that already holds another run."""
    save = config.checkpoint.save
    load = config.checkpoint.load
    run_dir = config.logging.run_dir
    problems = []
    if save and not _loads_from(load, save):
        held = what_it_holds(save)
        if held:
            problems.append(
                f"--save {save} already holds a run ({held}) that this run would overwrite:"
                f" pass --load {save} to continue it, or a new --save directory"
            )
    if run_dir and not load and not (save and _same(run_dir, save)):
        metrics = Path(run_dir) / METRICS_FILE
        if metrics.is_file() and metrics.stat().st_size > 0:
            problems.append(
                f"--run-dir {run_dir} already holds a run's {METRICS_FILE} that this run would"
                " append to: pass a new --run-dir, or --load a checkpoint to continue that run"
            )
    return problems
