"""Megatron's ways to end a run early and cleanly: ``--exit-signal-handler`` (SIGTERM, what SLURM
sends before a time limit), ``--exit-interval N`` and ``--exit-duration-in-mins M``. The engine
asks after each step; when one holds, it saves (with ``--save``) and ends with exit code 0.

A signal reaches the ranks at different moments and each rank's clock is its own, so the ranks
agree with a MAX all-reduce after every step: all of them stop after the same step.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist


class ExitConditions:
    """Which exit condition, if any, holds after a step. ``close()`` restores SIGTERM."""

    def __init__(self, checkpoint: Any, topology: Any, device: torch.device) -> None:
        self.interval = checkpoint.exit_interval
        self.minutes = checkpoint.exit_duration_in_mins
        self.topology, self.device = topology, device
        self.started = time.monotonic()
        self.signalled = False
        self._previous = None
        if checkpoint.exit_signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def reason(self, iteration: int) -> str | None:
        """Why the run should stop after ``iteration`` (None: go on). A collective when a signal
        or a duration is watched: every rank calls it after every step."""
        if self.interval is not None and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        if self.minutes is None and self._previous is None:
            return None
        late = self.minutes is not None and time.monotonic() - self.started > self.minutes * 60
        flags = torch.tensor([float(self.signalled), float(late)], device=self.device)
        if self.topology.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return "SIGTERM (--exit-signal-handler)"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {self.minutes:g}"
        return None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
