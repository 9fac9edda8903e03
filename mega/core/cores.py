"""How many CPU cores this process may use: the cores a SLURM allocation or ``taskset`` gives it,
not the node's (``os.cpu_count()`` counts the node's)."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The CPU cores this process may run on (every core where the platform cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
