"""Run ``mega`` from a test: in this process through click's runner, or as the real console
entry point in a subprocess."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A GPT that trains a step in a few milliseconds on one CPU core.
TINY_GPT = [
    "--model", "gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3",
]  # fmt: skip


def make_test_plugins(*extra: Any) -> Any:
    """A plugin manager with the built-in plugins and ``extra`` plugin objects (modules or
    objects with ``@hookimpl`` functions), registered after them as a third party's would be."""
    from mega.core.plugins.manager import make_plugins

    named = [(getattr(p, "__name__", type(p).__name__), p) for p in extra]
    return make_plugins(extra=named)


@dataclass
class CommandResult:
    exit_code: int
    output: str  # stdout
    stderr: str


def invoke(args: list[str], plugins: Any) -> CommandResult:
    """``mega ARGS`` in this process with ``plugins``, through the same error handling as the
    console entry point (bad input: ``error:`` lines on stderr and exit code 2)."""
    from mega.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args, plugins)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return CommandResult(code, out.getvalue(), err.getvalue())


def with_free_port(args: list[str]) -> list[str]:
    """``args`` plus ``--master-port FREE`` when they launch ranks on one node and name no port."""
    from mega.testing.ranks import free_port

    launches = any(a.startswith("--nproc") for a in args)
    named = any(a.startswith(("--master-port", "--master_port", "--nnodes")) for a in args)
    return [*args, "--master-port", str(free_port())] if launches and not named else list(args)


def run_mega(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the real ``mega`` console entry point in a subprocess (one torch thread, no
    third-party plugins unless ``env`` turns autoload back on). A launched single-node job
    gets a free rendezvous port unless ``args`` name one: tests that run side by side
    (``pytest -n``) would otherwise meet at the default 29500."""
    args = with_free_port(args)
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


def train_losses(args: list[str], run_dir: Path) -> list[float]:
    """Train ``mega train ARGS`` in this process (built-in plugins, no console output) with
    ``--run-dir run_dir``; the lm losses of its iterations, from its metrics.jsonl."""
    import json

    from mega.core.config.resolve import resolve_config
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine

    plugins = make_plugins()
    config = resolve_config([*args, "--run-dir", str(run_dir)], plugins)
    Engine(config, plugins, Display(rich_output=False)).train()
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["lm_loss"] for r in rows if "lm_loss" in r]
