"""Ctrl-C and SIGTERM during preprocessing, delivered even when their first raise is lost.

Python raises a signal handler's exception at whatever bytecode the main thread is running. If
that is code which cannot propagate it (a ``__del__`` or a weakref callback run by the garbage
collector: Python prints "Exception ignored" and goes on), the run carries on as if nothing
happened; a CI run once saw preprocessing keep going for 30 s after SIGINT. So the handlers also
record the signal, and the chunk loop calls :func:`check` to raise it again.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that no ``except Exception`` swallows it."""


_requested: type[BaseException] | None = None


def _handler(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = KeyboardInterrupt if signum == signal.SIGINT else Terminated
    raise _requested()


def check() -> None:
    """Raise the stop a signal asked for, if any (again, if its first raise was swallowed)."""
    if _requested is not None:
        raise _requested()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt and SIGTERM (a cancelled SLURM job, ``kill``)
    ``Terminated`` inside the block, and :func:`check` raises them again."""
    global _requested
    _requested = None
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _requested = None
