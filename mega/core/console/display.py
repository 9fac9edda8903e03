"""Rank 0's console: rich live progress on a terminal, plain one-line logs otherwise (CI, SLURM).

Iteration lines always go to stdout as text, so they read the same in a log file and on screen.
Plugins never print; they return data to hooks or use ``logging``.

In a job of several processes rank 0 owns the console. The other ranks print only warnings
(``Display.warn``) and errors (``mega.cli.main``), each prefixed with the rank that says it,
``[rank 3] warning: ...``, so that a message seen in a log of eight interleaved workers says whose
it is.
"""

from __future__ import annotations

import sys
from typing import Any


def rank_prefix(rank: int) -> str:
    """``"[rank 3] "`` for a message from a rank other than 0; rank 0 speaks unprefixed."""
    return f"[rank {rank}] " if rank > 0 else ""


class Display:
    """What the engine shows.

    ``enabled=False`` (ranks other than 0) prints nothing but warnings; ``rank`` is this process's
    global rank, used to prefix those warnings.
    """

    def __init__(
        self, enabled: bool = True, rich_output: bool | None = None, *, rank: int = 0
    ) -> None:
        self.enabled = enabled
        self.rank = rank
        self.rich = sys.stdout.isatty() if rich_output is None else rich_output
        self._console: Any = None
        self._progress: Any = None
        self._task: Any = None
        if self.enabled and self.rich:
            from rich.console import Console

            self._console = Console(highlight=False)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._console is not None:
            self._console.print(text, markup=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """A warning every rank prints, to stderr: ``warning: text`` (``[rank N] warning: text``).

        Printed through ``sys.stderr`` as it is at call time: while a rich progress bar is live it
        has replaced ``sys.stderr`` with a proxy that prints above the bar instead of through it.
        """
        print(f"{rank_prefix(self.rank)}warning: {text}", file=sys.stderr, flush=True)

    def panel(self, title: str, lines: list[str]) -> None:
        if not self.enabled:
            return
        if self._console is None:
            for line in lines:
                print(f"{title}: {line}" if title else line, flush=True)
            return
        from rich.panel import Panel

        self._console.print(Panel("\n".join(lines), title=title, expand=False), markup=False)

    def start_progress(self, total: int, done: int, description: str) -> None:
        if not self.enabled or self._console is None:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self._console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=done, status="")

    def advance(self, completed: int, status: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, status=status)

    def stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
