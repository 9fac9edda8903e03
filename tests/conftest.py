"""Shared fixtures: a fresh plugin manager per test, tiny-model flags, and a CLI runner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# A GPT that trains a step in a few milliseconds on one CPU core.
TINY = [
    "--model", "gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3",
]  # fmt: skip

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

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+) \|")


def lm_losses(stdout: str) -> dict[int, str]:
    """iteration -> the printed `lm loss` text, exactly as printed (for digit-exact comparisons)."""
    return {int(it): loss for it, loss in LOSS.findall(stdout)}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Tests see built-in plugins only, unless they opt back in, and run in their own directory
    (a run without --save or --run-dir writes runs/<model>-<time> under the working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGA_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MEGA_PLUGINS", raising=False)
    monkeypatch.delenv("MEGA_BLOCK_PLUGINS", raising=False)
    monkeypatch.delenv("MEGA_PLUGINS_DIR", raising=False)


@pytest.fixture
def plugins():
    from mega.core.plugins.manager import make_plugins

    return make_plugins()


def run_mega(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    """Run the real ``mega`` console entry point in a subprocess (one torch thread)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGA_DISABLE_PLUGIN_AUTOLOAD": "1"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mega", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
