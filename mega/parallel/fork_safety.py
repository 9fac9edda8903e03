"""Whether this process may still ``fork()`` workers that do everything a rank does.

mega forks its ranks (``mega train --nproc-per-node``, the test ranks of ``mega.testing``)
because a forked worker starts in milliseconds. Some libraries forbid it once used: tensorstore
aborts a forked child that touches it if the parent had used it ("fork() use detected"). Code
that uses such a library says so here, and the launchers spawn instead. Nor may a process fork
while other threads run in it: the child has only the forking thread, so whatever another thread
held or was to answer is never released there. After an in-process ``torch.compile``, inductor's
compile pool (threads reading its worker's results) stays up, and forked ranks that then compiled
waited forever for kernels (CPU, torch 2.13: tests/test_fork_safety.py).
"""

from __future__ import annotations

import threading

_used: list[str] = []


def note_fork_unsafe(library: str) -> None:
    """Record that this process has used ``library``, which a forked child could not use."""
    if library not in _used:
        _used.append(library)


def fork_unsafe_reason() -> str | None:
    """What makes forking unsafe here: a library used, or threads running beside this one
    (None: fork is safe)."""
    if _used:
        return _used[0]
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    return f"threads running in this process ({', '.join(others)})" if others else None
