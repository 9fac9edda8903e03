"""Shared test helpers. The isolation (own directory, no third-party autoload), the ``gpu``
marker and the plugin fixtures come from mega's pytest plugin, ``mega.testing``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mega.testing import TINY_GPT as TINY  # noqa: F401 - tests import these from here
from mega.testing import run_mega  # noqa: F401

# Under ``pytest -n N`` each worker, and every process it starts that does not set its own
# OMP_NUM_THREADS (benchmark scripts, the quickstart), gets its share of the cores rather than
# all of them: with N workers each running torch on every core, OpenMP threads wait at barriers
# for a descheduled sibling and burn the time (the quickstart smoke run on a busy 2-core
# machine: 56 s of CPU with 2 threads, 17 s with 1). Set before torch is imported (test modules
# import it after this conftest); a value the user set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# What a launcher (torchrun, SLURM) sets: scrubbed from a test's subprocess environment so that a
# multi-process run started from a test inside such a job still forms its own group.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def run_workers(
    worker: str, ranks: int, env: dict[str, str] | None = None, timeout: float = 300
) -> str:
    """``tests/WORKER`` on ``ranks`` local processes by torchrun (standalone), ``env`` added to
    this process's: its stdout, once every rank has exited 0 (else the output's tail fails)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(Path(__file__).with_name(worker))]
    environ = {**os.environ, **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+) \|")


def lm_losses(stdout: str) -> dict[int, str]:
    """iteration -> the printed `lm loss` text, exactly as printed (for digit-exact comparisons)."""
    return {int(it): loss for it, loss in LOSS.findall(stdout)}


@pytest.fixture
def plugins():
    from mega.core.plugins.manager import make_plugins

    return make_plugins()


def _commands_in_fork(rank: int, world_size: int, commands: list[list[str]], cwd: str) -> list:
    import os

    from mega.testing.commands import invoke, make_test_plugins

    os.chdir(cwd)
    return [invoke(args, make_test_plugins()) for args in commands]


def mega_in_fork(commands: list[list[str]], cwd) -> list:
    """``mega ARGS`` for each of ``commands`` in turn, in one fork of this process started in
    ``cwd``: their results (``exit_code``, ``output``, ``stderr``). A fork starts in milliseconds
    where ``run_mega``'s interpreter imports torch (seconds); a fork, not this process, since
    tensorstore (mega's checkpoints) forbids forking a process that has used it. Checks of what
    the console entry point itself prints keep ``run_mega``."""
    from mega.testing.ranks import run_ranks

    return run_ranks(_commands_in_fork, 1, commands, str(cwd), timeout=300)[0]
