"""A plugin that says what is alive at one step's memory peak on a GPU: load it with
``MEGA_PLUGINS_DIR=benchmarks/plugins MEGA_MEMORY_PEAK=DIR`` (``MEGA_MEMORY_PEAK_AT=N``: the step
after iteration N, default 6).

Rank 0 writes ``DIR/memory_peak.txt``: the memory allocated between steps (parameters,
gradients, optimizer states: what ``mega plan`` calls static), the step's peak above it, and the
blocks alive at that peak summed by where they were allocated (the innermost ``mega/`` frame and
the innermost frame, an inductor kernel file for a compiled graph's buffers; a compiled
graph's buffers are named by the source line that made them), with their sizes. It records the
allocator's history for that one step (``torch.cuda.memory._record_memory_history``) and replays
it, so what lives at the peak is known without a profiler. A planner's peak that misses a run's
is read against this table.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from mega import hookimpl

GIB = 2**30


def _where(frames: list[dict]) -> tuple[str, str]:
    """(innermost mega frame, innermost frame) of an allocation's Python stack."""
    names = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames]
    mega = next(
        (n for f, n in zip(frames, names, strict=True) if "/mega/" in f["filename"]), "(none)"
    )
    return mega, names[0] if names else "(none)"


def live_at_peak(events: list[dict]) -> tuple[int, dict[tuple[str, str], list[int]]]:
    """Replay an allocator trace: the highest sum of the blocks it allocated and had not freed,
    and those blocks' sizes by where they were allocated."""
    live: dict[int, tuple[int, tuple[str, str]]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, tuple[str, str]]] = {}
    for event in events:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_place: dict[tuple[str, str], list[int]] = defaultdict(list)
    for size, place in at_peak.values():
        by_place[place].append(size)
    return peak, dict(by_place)


def _blocks(sizes: list[int]) -> str:
    """``12 x 184.5 MB, ...``: the blocks' sizes, the largest first."""
    counts: dict[int, int] = defaultdict(int)
    for size in sizes:
        counts[size] += 1
    return ", ".join(f"{n} x {size / 1e6:.1f} MB" for size, n in sorted(counts.items())[::-1][:4])


class _MemoryPeak:
    def __init__(self) -> None:
        self.at = int(os.environ.get("MEGA_MEMORY_PEAK_AT", "6"))
        self.between = 0

    def step_end(self, engine: Any, iteration: int, metrics: dict[str, float]) -> None:
        import torch

        out = os.environ.get("MEGA_MEMORY_PEAK")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if not out or rank != 0 or not torch.cuda.is_available():
            return
        if iteration == self.at:
            torch.cuda.synchronize()
            self.between = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(
                "all", context="alloc", stacks="python", max_entries=1_000_000
            )
        elif iteration == self.at + 1:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(None)
            events = snapshot["device_traces"][torch.cuda.current_device()]
            replayed, by_place = live_at_peak(events)
            lines = [
                f"iteration {iteration}: between steps {self.between / GIB:.3f} GiB, peak"
                f" {peak / GIB:.3f} GiB ({(peak - self.between) / GIB:.3f} above);"
                f" the step's own blocks at their peak {replayed / GIB:.3f} GiB"
                f" ({len(events)} allocator events)",
                "GiB  blocks allocated at (innermost mega frame | innermost frame)",
            ]
            for (mega, inner), sizes in sorted(by_place.items(), key=lambda kv: -sum(kv[1])):
                if sum(sizes) >= 2**20:
                    lines.append(f"{sum(sizes) / GIB:7.3f}  {mega} | {inner} | {_blocks(sizes)}")
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, "memory_peak.txt").write_text("\n".join(lines) + "\n")


_peak = _MemoryPeak()


@hookimpl
def step_end(engine: Any, iteration: int, metrics: dict[str, float]) -> None:
    _peak.step_end(engine, iteration, metrics)
