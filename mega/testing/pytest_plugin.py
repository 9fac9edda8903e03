"""mega's pytest plugin (entry point ``pytest11``): fixtures for mega's tests and plugin packages'.

Every test runs in its own directory with third-party plugin autoload off (a test opts plugins in
through ``mega_plugins``/``mega_cli``), so an installed plugin cannot change another's results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is available."""
    if not any("gpu" in item.keywords for item in items):
        return  # no torch import for suites without GPU tests
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mega_isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Built-in plugins only unless a test opts others in, and a directory of its own (a run
    without --save or --run-dir writes runs/<model>-<time> under the working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGA_DISABLE_PLUGIN_AUTOLOAD", "1")
    for name in ("MEGA_PLUGINS", "MEGA_BLOCK_PLUGINS", "MEGA_PLUGINS_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mega_plugins() -> Callable[..., Any]:
    """``mega_plugins(*plugin_objects)``: a fresh plugin manager, built-ins plus these."""
    from mega.testing.commands import make_test_plugins

    return make_test_plugins


@pytest.fixture
def mega_cli() -> Callable[..., Any]:
    """``mega_cli(args, *plugin_objects)``: run ``mega ARGS`` in this process with the built-in
    plugins plus these; the result has ``exit_code``, ``output`` (stdout) and ``stderr``."""
    from mega.testing.commands import invoke, make_test_plugins

    def run(args: list[str], *extra: Any) -> Any:
        return invoke(args, make_test_plugins(*extra))

    return run


@pytest.fixture
def tiny_gpt() -> list[str]:
    """Flags of a GPT that trains a step in milliseconds on one CPU core (a fresh list)."""
    from mega.testing.commands import TINY_GPT

    return list(TINY_GPT)
