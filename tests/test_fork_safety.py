"""Ranks are forked only from a process that may fork: no library in it that forbids it, and no
thread running beside the forking one (mega.parallel.fork_safety)."""

from __future__ import annotations

import threading

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
