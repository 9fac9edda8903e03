"""Ctrl-C and SIGTERM during preprocessing, acted on at safe points.

The handlers only record the signal; the chunk loop raises it (:func:`check`), and its waits for
workers poll (:func:`result`), so a run stops within a fraction of a second. A handler that
raised at whatever bytecode the main thread was running could lose the stop (raised inside a
``__del__`` or weakref callback, Python prints "Exception ignored" and goes on: CI once saw
preprocessing run on for 30 s after SIGINT), or raise inside ``concurrent.futures``'s own
bookkeeping and leave it locked, so that stopping the pool hung (a CI run after SIGTERM, with
the progress line printed and nothing after it for 30 s).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from types import FrameType
from typing import Any


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that no ``except Exception`` swallows it."""


_requested: type[BaseException] | None = None


def _handler(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = KeyboardInterrupt if signum == signal.SIGINT else Terminated


def check() -> None:
    """Raise the stop a signal asked for, if any."""
    if _requested is not None:
        raise _requested()


def result(future: Future, poll: float = 0.1) -> Any:
    """``future.result()``, raising a signal's stop within ``poll`` seconds of it."""
    while True:
        check()
        try:
            return future.result(timeout=poll)
        except TimeoutError:
            continue


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM (a cancelled SLURM job, ``kill``) are recorded, and
    :func:`check` and :func:`result` raise them: KeyboardInterrupt and ``Terminated``."""
    global _requested
    _requested = None
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _requested = None
