"""What Ctrl-C of ``mega train`` says: where the run stopped, and what ``--load`` resumes from."""

from __future__ import annotations

from typing import Any

from mega.core.checkpoint.existing_run import checkpoint_iteration
from mega.core.checkpoint.store import find_checkpoint


def resume_point(save: str | None, load: str | None) -> tuple[str, Any] | None:
    """``(directory to pass to --load, its checkpoint directory)`` for the newest complete
    checkpoint of this run (its ``--save`` directory first, else the one it loaded), or None."""
    for directory in (save, load):
        if directory:
            found = find_checkpoint(directory)
            if found is not None:
                return directory, found
    return None


def interrupted_message(engine: Any) -> str:
    """One line: ``interrupted after iteration 37 of 500; --load D resumes from ...``."""
    cfg = engine.config
    where = f"interrupted after iteration {engine.iteration} of {cfg.train_iters}"
    found = resume_point(cfg.checkpoint.save, cfg.checkpoint.load)
    if found is None:
        every = cfg.checkpoint.save_interval
        if cfg.checkpoint.save and every:
            return f"{where}; no checkpoint to resume from yet (--save-interval {every})"
        how = "--save DIR --save-interval N" if not cfg.checkpoint.save else "--save-interval N"
        return f"{where}; no checkpoint to resume from ({how} writes them)"
    directory, checkpoint = found
    iteration = checkpoint_iteration(checkpoint)
    at = f"iteration {iteration}" if iteration is not None else "its checkpoint"
    return f"{where}; --load {directory} resumes from {at} ({checkpoint})"
