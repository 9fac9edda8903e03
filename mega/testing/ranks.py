"""Run a function on N CPU ranks (gloo) the fast way: fork, with torch already imported.

Spawning N fresh interpreters costs seconds per rank on 2 cores; forking a parent that has
imported torch and mega costs milliseconds (platform notes §2). A rank that raises, or a run that
outlives its timeout, fails the test with that rank's traceback; no rank is left hanging.

    def body(rank, world_size, scale):      # module-level, runs in every rank
        ...
        return something_picklable
    results = run_ranks(body, 2, 3.0)      # [result of rank 0, result of rank 1]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import random
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class RankFailed(AssertionError):
    """A rank raised, died or timed out."""


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel picks outgoing connections' local ports from (Linux's default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nobody listens on, chosen outside the ephemeral range.

    Asking the kernel for port 0 returns an ephemeral port, which is free only until the kernel
    hands it to someone's outgoing connection: a test beside this one (``pytest -n``) connects
    gloo pairs and store clients all the time, and took the port between this check and the
    launcher's bind once (CI: "cannot start the rendezvous ... the port is in use"). Outside the
    ephemeral range only an explicit bind takes a port; a random pick makes two tests choosing
    the same one unlikely. (With no room outside the range: the kernel's pick.)"""
    low, high = _ephemeral_ports()
    lowest, highest = max((10000, low - 1), (high + 1, 65535), key=lambda r: r[1] - r[0])
    pick = random.SystemRandom()
    for _ in range(200 if highest - lowest >= 1024 else 0):
        port = pick.randint(lowest, highest)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank, world_size, port, results, args, env) -> None:
    code = 0
    try:
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(env or {}),
            }
        )
        torch.set_num_threads(1)
        # plain pickle: torch's queue pickler would share tensors through file descriptors that
        # die with this process
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()  # flush before _exit, or the parent never sees the result
        os._exit(code)  # skip pytest's atexit handlers, inherited through fork


def _context() -> Any:
    """fork; once this process has used a library that forbids forking (tensorstore, after an
    in-process checkpoint), fork from a forkserver instead: a fresh interpreter that has
    imported torch and the engine once and never used tensorstore, so ranks still start fast."""
    from mega.parallel.fork_safety import fork_unsafe_reason

    if not fork_unsafe_reason():
        return mp.get_context("fork")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "mega.core.training.engine", __name__])
    return context


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; their results by rank."""
    context = _context()
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_child, args=(fn, r, world_size, port, results, args, env))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:  # nothing yet: check nobody died silently
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and all(r not in collected for r in dead):
                    # a rank died without reporting (segfault, os._exit, OOM kill)
                    raise RankFailed(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            collected[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            proc.join(timeout=0 if len(collected) < world_size else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[r] for r in range(world_size)]
