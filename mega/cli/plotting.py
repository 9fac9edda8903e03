"""What ``mega plot`` and ``mega schedule --png`` share: matplotlib (an optional extra, imported
only when a picture is asked for, so ``mega --help`` stays fast) and writing the file.

Figures are built with ``matplotlib.figure.Figure`` directly: no pyplot, no GUI backend, no
global state. SVG keeps its text as text (``svg.fonttype = none``), so labels stay searchable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mega.errors import MegaUsageError

FORMATS = ("png", "svg", "pdf")
INSTALL = "pip install 'mega[plot]' (or pip install matplotlib)"


def new_figure(flag: str, **kwargs: Any) -> Any:
    """A matplotlib ``Figure``; a one-line error naming ``flag`` when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MegaUsageError(f"{flag} needs matplotlib: {INSTALL}") from None
    return Figure(**kwargs)


def output_format(flag: str, path: str) -> str:
    """The file format from the name's suffix (png without one); an error for another suffix."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in FORMATS:
        raise MegaUsageError(
            f"{flag} {path}: cannot write .{suffix} files (use {', '.join('.' + f for f in FORMATS)})"
        )
    return suffix


def check_writable(flag: str, path: str) -> str:
    """Fail before any work when ``path`` cannot be written; returns its format."""
    fmt = output_format(flag, path)
    directory = Path(path).parent
    if not directory.is_dir():
        raise MegaUsageError(f"{flag} {path}: directory '{directory}' does not exist")
    if Path(path).is_dir():
        raise MegaUsageError(f"{flag} {path}: is a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise MegaUsageError(f"{flag} {path}: directory '{directory}' is not writable")
    return fmt


def save_figure(figure: Any, path: str, flag: str, dpi: int = 100) -> Path:
    """Write ``figure`` to ``path`` atomically (a temporary file, then a rename)."""
    import matplotlib

    fmt = output_format(flag, path)
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "mega"}):
            figure.savefig(temporary, format=fmt, dpi=dpi, bbox_inches="tight")
        os.replace(temporary, target)
    except OSError as exc:
        raise MegaUsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return target
