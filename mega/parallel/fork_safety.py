"""Whether this process may still ``fork()`` workers that do everything a rank does.

mega forks its ranks (``mega train --nproc-per-node``, the test ranks of ``mega.testing``)
because a forked worker starts in milliseconds. Some libraries forbid it once used: tensorstore
aborts a forked child that touches it if the parent had used it ("fork() use detected"). Code
that uses such a library says so here, and the launchers spawn instead.
"""

from __future__ import annotations

_used: list[str] = []


def note_fork_unsafe(library: str) -> None:
    """Record that this process has used ``library``, which a forked child could not use."""
    if library not in _used:
        _used.append(library)


def fork_unsafe_reason() -> str | None:
    """The library that makes forking unsafe here (None: fork is safe)."""
    return _used[0] if _used else None
