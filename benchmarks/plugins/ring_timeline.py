"""A plugin that times context parallelism's ring step by step on every rank of a ``mega train``,
without the profiler (which about doubles the host's time per op, and so changes how long ranks
wait for one another): load it with ``MEGA_PLUGINS_DIR=benchmarks/plugins MEGA_RING_TIMELINE=DIR``
(``MEGA_RING_TIMELINE_AT=N``: the step after iteration N is recorded, default 5).

Around every send and every arrival of the ring's lanes (:mod:`mega.parallel.context.lanes`)
during that step, each rank notes the host's clock and, on a GPU, records a CUDA event on the
compute stream: before and after the stream's wait for an arrival. Times count from an event
recorded after a barrier and a synchronize at the step's start, when the host's clock and the GPU
agree, so on one host the ranks' rows share an origin to within the barrier's skew. Each rank
writes ``DIR/ring_rank<R>.json``: its rows (lane, what, host_ms, gpu_ms, and for arrivals
wait_ms: how long the compute stream waited for the block) and a summary. Reading it:

- an arrival's ``wait_ms``: the stream waited for a neighbour (its transfer, or its host);
- ``gpu_ms - host_ms`` near zero: the GPU reached the point as soon as the host posted it, so the
  GPU had run dry and the host was late; large: the host ran ahead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mega import hookimpl


class _Timeline:
    def __init__(self) -> None:
        self.at = int(os.environ.get("MEGA_RING_TIMELINE_AT", "5"))
        self.recording = False
        self.marks: list[dict[str, Any]] = []
        self.origin: Any = None
        self.host_origin = 0.0
        self.patched = False

    def mark(self, lane: str, what: str) -> dict[str, Any]:
        import torch

        row: dict[str, Any] = {"lane": lane, "what": what, "host": time.perf_counter()}
        if torch.cuda.is_available():
            row["event"] = torch.cuda.Event(enable_timing=True)
            row["event"].record()
        self.marks.append(row)
        return row

    def patch(self) -> None:
        from mega.parallel.context import ring

        if self.patched:
            return
        original, timeline = ring.lane, self

        def timed_lane(group: Any, to: int, frm: int, name: str, like: Any) -> Any:
            inner = original(group, to, frm, name, like)
            return _TimedLane(inner, name, timeline) if timeline.recording else inner

        ring.lane = timed_lane
        self.patched = True

    def start(self) -> None:
        import torch
        import torch.distributed as dist

        self.patch()
        if dist.is_initialized():
            dist.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        self.host_origin = time.perf_counter()
        self.marks, self.recording = [], True

    def stop(self, out: Path, iteration: int) -> None:
        import torch
        import torch.distributed as dist

        self.recording = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - self.host_origin) * 1e3
        rows = []
        for row in self.marks:
            done = {"lane": row["lane"], "what": row["what"]}
            done["host_ms"] = round((row["host"] - self.host_origin) * 1e3, 3)
            if "event" in row:
                done["gpu_ms"] = round(self.origin.elapsed_time(row["event"]), 3)
            rows.append(done)
        for before, after in zip(rows, rows[1:], strict=False):  # a wait's two marks
            if before["what"] == "waits" and after["what"] == "arrived" and "gpu_ms" in after:
                after["wait_ms"] = round(after["gpu_ms"] - before["gpu_ms"], 3)
        waits = [r["wait_ms"] for r in rows if "wait_ms" in r]
        lags = [r["gpu_ms"] - r["host_ms"] for r in rows if "gpu_ms" in r]
        summary = {
            "iteration": iteration,
            "step_ms_host": round(step_ms, 1),
            "sends": sum(r["what"] == "sends" for r in rows),
            "arrivals": sum(r["what"] == "arrived" for r in rows),
            "arrival_wait_ms_total": round(sum(waits), 1) if waits else None,
            "marks_gpu_within_50us_of_host": sum(lag < 0.05 for lag in lags) if lags else None,
            "marks": len(rows),
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        out.mkdir(parents=True, exist_ok=True)
        record = {"rank": rank, "summary": summary, "rows": rows}
        Path(out, f"ring_rank{rank}.json").write_text(json.dumps(record, indent=1) + "\n")


class _TimedArrival:
    def __init__(self, inner: Any, lane: str, timeline: _Timeline) -> None:
        self.inner, self.lane, self.timeline = inner, lane, timeline

    def wait(self) -> Any:
        self.timeline.mark(self.lane, "waits")
        received = self.inner.wait()
        self.timeline.mark(self.lane, "arrived")
        return received


class _TimedLane:
    def __init__(self, inner: Any, lane: str, timeline: _Timeline) -> None:
        self.inner, self.lane, self.timeline = inner, lane, timeline

    def send(self, tensors: list) -> _TimedArrival:
        self.timeline.mark(self.lane, "sends")
        return _TimedArrival(self.inner.send(tensors), self.lane, self.timeline)

    def own(self, tensor: Any) -> Any:
        return self.inner.own(tensor)

    def finish(self) -> None:
        self.inner.finish()


_timeline = _Timeline()


@hookimpl
def step_end(engine: Any, iteration: int, metrics: dict[str, float]) -> None:
    out = os.environ.get("MEGA_RING_TIMELINE")
    if not out:
        return
    if iteration == _timeline.at:
        _timeline.start()
    elif iteration == _timeline.at + 1 and _timeline.recording:
        _timeline.stop(Path(out), iteration)
