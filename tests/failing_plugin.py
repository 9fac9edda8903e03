"""A third-party-style plugin that makes one rank fail, for tests/test_launch.py.

Loaded as a plugin file (``MEGA_PLUGINS_DIR`` pointing at a directory holding a copy of it).
Environment: ``FAIL_RANK`` (default 1; ``all``: every rank), ``FAIL_ITERATION`` (default 2) and ``FAIL_HOW``:

- ``run-error`` (default): raise ``MegaRunError`` (the rank exits 1 with its ``error:`` line);
- ``usage-error``: raise ``MegaUsageError`` (exit 2);
- ``bug``: raise a plain ``RuntimeError`` (a traceback, exit 1);
- ``segfault``: die from SIGSEGV, printing nothing of its own.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from mega import hookimpl
from mega.errors import MegaRunError, MegaUsageError


@hookimpl
def step_end(engine: Any, iteration: int, metrics: dict[str, float]) -> None:
    rank = engine.topology.rank
    failing = os.environ.get("FAIL_RANK", "1")
    if failing != "all" and rank != int(failing):
        return
    if iteration != int(os.environ.get("FAIL_ITERATION", "2")):
        return
    how = os.environ.get("FAIL_HOW", "run-error")
    if how == "usage-error":
        raise MegaUsageError(f"planted bad input on rank {rank} at iteration {iteration}")
    if how == "bug":
        raise RuntimeError(f"planted bug on rank {rank} at iteration {iteration}")
    if how == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    raise MegaRunError(f"planted failure on rank {rank} at iteration {iteration}")
