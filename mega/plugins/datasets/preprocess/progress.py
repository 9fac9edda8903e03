"""Progress while preprocessing (docs/s, MB/s) and the final summary.

On a terminal: a rich progress bar over the input's bytes on disk, with documents, docs/s and
MB/s. Elsewhere (CI, SLURM logs): Megatron's plain line, on stderr, each time another
``--log-interval`` documents are done::

    Processed 20000 documents (3210.5 docs/s, 6.52 MB/s).

MB/s counts the JSONL text processed (uncompressed), in units of 10^6 bytes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

MB = 1_000_000


@dataclass
class Totals:
    docs: int = 0
    tokens: int = 0
    text_bytes: int = 0
    disk_bytes: int = 0
    bad_lines: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)


class Progress:
    """Shows ``Totals`` as they grow; ``tty=None`` decides from ``stream.isatty()``."""

    def __init__(
        self,
        totals: Totals,
        total_disk_bytes: int,
        log_interval: int,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ):
        self.totals = totals
        self.total = total_disk_bytes
        self.log_interval = log_interval
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._next_log = log_interval
        self._rich = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("[bold]preprocess"),
                BarColumn(),
                DownloadColumn(binary_units=False),
                TextColumn("{task.fields[rates]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                refresh_per_second=4,
            )
            self._rich.start()
            self._task = self._rich.add_task("preprocess", total=self.total or None, rates="")
        return self

    def update(self) -> None:
        t = self.totals
        if self._rich is not None:
            rates = (
                f"{t.docs:,} docs · {t.docs / t.seconds:,.0f} docs/s"
                f" · {t.text_bytes / MB / t.seconds:.2f} MB/s"
            )
            self._rich.update(self._task, completed=t.disk_bytes, rates=rates)
        elif t.docs >= self._next_log:
            print(
                f"Processed {t.docs} documents ({t.docs / t.seconds:.1f} docs/s,"
                f" {t.text_bytes / MB / t.seconds:.2f} MB/s).",
                file=self.stream,
                flush=True,
            )
            self._next_log = (t.docs // self.log_interval + 1) * self.log_interval

    def warn(self, message: str) -> None:
        """A line above the progress bar (or just a line, off a terminal)."""
        if self._rich is not None:
            self._rich.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()


def summary_lines(totals: Totals, outputs: list[str], dtype: str) -> list[str]:
    """The lines printed when a run is done."""
    t = totals
    lines = [
        f"preprocessed {t.docs:,} documents, {t.tokens:,} tokens, {t.text_bytes / MB:,.1f} MB"
        f" in {t.seconds:.1f} s ({t.text_bytes / MB / t.seconds:.2f} MB/s,"
        f" {t.docs / t.seconds:,.0f} docs/s)"
    ]
    if t.bad_lines:
        lines.append(f"skipped {t.bad_lines:,} bad lines (--skip-bad-lines)")
    lines += [f"wrote {prefix}.bin/.idx ({dtype})" for prefix in outputs]
    return lines
