"""Ranks are forked only from a process that may fork: no library in it that forbids it, and no
thread running beside the forking one (mega.parallel.fork_safety)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from mega.parallel import fork_safety
from mega.parallel.fork_safety import fork_unsafe_reason
from mega.testing.ranks import run_ranks

# held by a thread of the parent in the test below; a forked child gets it held, by nobody
HELD_BY_A_PARENT_THREAD = threading.Lock()


def _takes_the_lock(rank: int, world_size: int) -> bool:
    taken = HELD_BY_A_PARENT_THREAD.acquire(timeout=5)
    if taken:
        HELD_BY_A_PARENT_THREAD.release()
    return taken


def _holding(lock: threading.Lock, release: threading.Event, held: threading.Event) -> None:
    with lock:
        held.set()
        release.wait()


def test_a_running_thread_makes_forking_unsafe_and_names_itself(monkeypatch):
    # what earlier tests in this process did (tensorstore, an in-process compile's pool threads)
    # is not this test's subject
    monkeypatch.setattr(fork_safety, "_used", [])
    release, held = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=_holding, args=(threading.Lock(), release, held), name="compile-pool-reader"
    )
    thread.start()
    try:
        held.wait()
        assert "compile-pool-reader" in (fork_unsafe_reason() or "")
    finally:
        release.set()
        thread.join()
    assert "compile-pool-reader" not in (fork_unsafe_reason() or "")


def test_ranks_started_beside_a_thread_do_not_inherit_what_it_holds():
    """What hung forked ranks that compiled after an in-process torch.compile (inductor's pool
    threads): with a parent thread holding a lock, forked ranks would wait on it forever."""
    release, held = threading.Event(), threading.Event()
    thread = threading.Thread(target=_holding, args=(HELD_BY_A_PARENT_THREAD, release, held))
    thread.start()
    try:
        held.wait()
        assert run_ranks(_takes_the_lock, 2, timeout=120) == [True, True]
    finally:
        release.set()
        thread.join()


# a plugin that asks for CUDA at import, as many do: on a GPU host, unless torch asks NVML, that
# initialises the driver in the launcher and its forked workers cannot use CUDA
ASKS_AT_IMPORT = """
import os
print("fork-safe check at plugin import:", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
"""


def test_plugins_load_with_torch_asking_nvml_whether_there_is_cuda(tmp_path: Path):
    """``mega`` sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` before any plugin loads, so that a
    plugin's ``torch.cuda.is_available()`` at import asks NVML, not the driver: a driver that
    answered once spoils fork for the launcher's workers ("Cannot re-initialize CUDA in forked
    subprocess", seen on 2 H200 on 2026-11-29 through mega's own check), and
    ``torch.cuda.is_initialized()``, which the launcher asks before forking, does not say so."""
    (tmp_path / "asks_at_import.py").write_text(ASKS_AT_IMPORT)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["MEGA_PLUGINS_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "mega", "--help"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fork-safe check at plugin import: 1" in proc.stdout, proc.stdout[-2000:]
