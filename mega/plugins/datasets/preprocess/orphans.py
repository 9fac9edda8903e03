"""What a killed ``mega preprocess`` must not leave behind: live workers and temporary files.

- A worker dies with its parent. SIGKILL of the parent runs no cleanup code, so each worker asks
  the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)`` on Linux); elsewhere a
  daemon thread polls ``os.getppid()``.
- The builders write ``PREFIX.bin.tmp-PID`` / ``PREFIX.idx.tmp-PID`` and ``--partitions`` a hidden
  ``.mega-preprocess-PID-*`` directory. A later run for the same output removes those whose PID is
  no longer alive (never those of a run still going).
"""

from __future__ import annotations

import ctypes
import glob
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 1.0
TMP_DIR_PREFIX = ".mega-preprocess-"
_TMP_FILE = r"\.(?:bin|idx)\.tmp-(\d+)"
_TMP_DIR = re.compile(re.escape(TMP_DIR_PREFIX) + r"(\d+)-")


def die_with_parent() -> None:
    """Called in a forked worker: end this process as soon as its parent is gone."""
    parent = multiprocessing.parent_process()
    expected = parent.pid if parent is not None else os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != expected:  # the parent died before the request took effect
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(expected,), daemon=True).start()


def _watch_parent(expected: int) -> None:
    while os.getppid() == expected:
        time.sleep(POLL_SECONDS)
    os._exit(1)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def temporary_dir_prefix() -> str:
    """The prefix of this run's hidden ``--partitions`` directory (carries the PID)."""
    return f"{TMP_DIR_PREFIX}{os.getpid()}-"


def remove_stale_temporaries(outputs: list[str]) -> list[str]:
    """Delete temporaries of dead runs for these output prefixes; returns what was removed."""
    removed: list[str] = []
    for out in outputs:
        prefix = Path(out)
        directory = prefix.parent
        if not directory.is_dir():
            continue
        pattern = re.compile(re.escape(prefix.name) + _TMP_FILE)
        for path in directory.glob(f"{glob.escape(prefix.name)}.*.tmp-*"):
            match = pattern.fullmatch(path.name)
            if match and not pid_alive(int(match[1])):
                path.unlink(missing_ok=True)
                removed.append(str(path))
        for path in directory.glob(f"{TMP_DIR_PREFIX}*"):
            match = _TMP_DIR.match(path.name)
            if match and path.is_dir() and not pid_alive(int(match[1])):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    return removed
