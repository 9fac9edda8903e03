"""Shared test helpers. The isolation (own directory, no third-party autoload), the ``gpu``
marker and the plugin fixtures come from mega's pytest plugin, ``mega.testing``."""

from __future__ import annotations

import re

import pytest

from mega.testing import TINY_GPT as TINY  # noqa: F401 - tests import these from here
from mega.testing import run_mega  # noqa: F401

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


@pytest.fixture
def plugins():
    from mega.core.plugins.manager import make_plugins

    return make_plugins()
