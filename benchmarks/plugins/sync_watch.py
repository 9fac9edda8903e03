"""A plugin that lists where a GPU run's host waits for the GPU: load it with
``MEGA_PLUGINS_DIR=benchmarks/plugins MEGA_SYNC_WATCH=DIR`` (``MEGA_SYNC_WATCH_AT=N``: after
iteration N, default 10; two steps are watched).

A host that waits for the GPU (``.item()``, a copy to the CPU, ``torch.cuda.synchronize``, an
event's or a stream's ``synchronize``) loses its lead: the GPU then idles while the host launches
the next kernels. A profile shows the idle but not its cause; this names the code. PyTorch's
sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) reports the synchronizing operations
it knows; events' and streams' ``synchronize`` are wrapped here as well. Each rank writes
``DIR/syncs_rank<R>.txt``: every distinct call site, the number of times a step it synced, and
the stack outside torch that led to it.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from mega import hookimpl

STEPS = 2
SYNC_WARNING = "called a synchronizing CUDA operation"  # what the debug mode warns per sync
_TORCH = f"{os.sep}torch{os.sep}"


def call_site(stack: list[traceback.FrameSummary]) -> tuple[str, ...]:
    """The frames of ``stack`` outside torch, this file and the warnings machinery, innermost
    last: the code that asked for the sync."""
    keep = []
    for frame in stack:
        name = frame.filename
        if _TORCH in name or name == __file__ or name.endswith(f"{os.sep}warnings.py"):
            continue
        keep.append(f"{name}:{frame.lineno} {frame.name}")
    return tuple(keep[-6:])


class _SyncWatch:
    def __init__(self) -> None:
        self.at = int(os.environ.get("MEGA_SYNC_WATCH_AT", "10"))
        self.sites: Counter[tuple[str, tuple[str, ...]]] | None = None
        self.saved: dict[str, Any] = {}
        self.catcher: Any = None

    def record(self, kind: str) -> None:
        if self.sites is not None:
            self.sites[(kind, call_site(traceback.extract_stack()))] += 1

    def start(self) -> None:
        import torch

        self.sites = Counter()
        self.catcher = warnings.catch_warnings()
        self.catcher.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            # one sync; not the mode's own notice ("a prototype feature ... synchronizing ...")
            if str(message).startswith(SYNC_WARNING):
                self.record("sync debug: " + SYNC_WARNING)
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        for owner in (torch.cuda.Event, torch.cuda.Stream):
            original = owner.synchronize
            self.saved[owner.__name__] = original

            def wrapped(obj: Any, _original: Any = original, _kind: str = owner.__name__) -> Any:
                self.record(f"{_kind}.synchronize")
                return _original(obj)

            owner.synchronize = wrapped
        torch.cuda.set_sync_debug_mode("warn")

    def restore(self) -> Counter[tuple[str, tuple[str, ...]]]:
        """The debug mode off, ``synchronize`` and the warning filters as they were; the sites
        recorded so far."""
        import torch

        torch.cuda.set_sync_debug_mode("default")
        for owner in (torch.cuda.Event, torch.cuda.Stream):
            owner.synchronize = self.saved.pop(owner.__name__)
        self.catcher.__exit__(None, None, None)
        sites, self.sites = self.sites or Counter(), None
        return sites

    def stop(self, rank: int, out: Path) -> None:
        sites = self.restore()
        lines = [f"rank {rank}: {sum(sites.values()) / STEPS:g} host-GPU syncs a step"]
        for (kind, stack), count in sites.most_common():
            lines.append(f"\n{count / STEPS:g} a step: {kind}")
            lines.extend(f"    {frame}" for frame in stack)
        out.mkdir(parents=True, exist_ok=True)
        Path(out, f"syncs_rank{rank}.txt").write_text("\n".join(lines) + "\n")

    def step_end(self, iteration: int) -> None:
        import torch

        out = os.environ.get("MEGA_SYNC_WATCH")
        if not out or not torch.cuda.is_available():
            return
        if iteration == self.at:
            torch.cuda.synchronize()
            self.start()
        elif iteration == self.at + STEPS and self.sites is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.stop(rank, Path(out))

    def shutdown(self) -> None:
        """A run that ends inside the watched steps puts everything back, saying so."""
        if self.sites is None:
            return
        self.restore()
        print(
            f"sync_watch: the run ended before iteration {self.at + STEPS}, the end of the"
            f" watched steps (MEGA_SYNC_WATCH_AT={self.at}); nothing written",
            file=sys.stderr,
            flush=True,
        )


_watch = _SyncWatch()


@hookimpl
def step_end(engine: Any, iteration: int, metrics: dict[str, float]) -> None:
    _watch.step_end(iteration)


@hookimpl
def shutdown(engine: Any, exc: BaseException | None) -> None:
    _watch.shutdown()
