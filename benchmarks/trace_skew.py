"""Which rank each collective waits for, and why, from every rank's Chrome trace of one step
(``MEGA_RANK_PROFILE_TRACE=all`` of benchmarks/plugins/rank_profile.py writes them):

    python benchmarks/trace_skew.py DIR/ep2-world2/trace_rank*.json [--steps 2]

A collective cannot finish before its last rank arrives, so an early rank's NCCL kernel spins
until then: its duration hides a wait. The i-th NCCL kernel of a name on each rank is the same
collective (every rank launches them in one order). For each, the ranks' start times say who
came last and how long the others waited; and what the last rank's compute stream did in that
interval says why it was late: busy (more GPU work before the collective: the experts' load, a
slower GEMM) or idle (its host had not launched the work yet). Per step, in milliseconds.
Give the traces of ranks that run the same collectives (one group's ranks, or all ranks where
every rank runs every collective, as on 2 GPUs): kernels are matched by name and order only.

Why: on 2 H200 an EP2 step's trips took 16 ms of signal waits when their carrier no longer
spent time on bytes (session 50, docs/performance.md); whether imbalance or the hosts cause
the waits decides the remedy (routing balance, or the host's launch cost).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

from trace_summary import Interval, gpu_events, is_nccl_kernel, load, overlap, union


def _kernels(trace: dict[str, Any]) -> tuple[dict[str, list[Interval]], list[Interval]]:
    """A rank's NCCL kernels by name (in time order) and its other kernels' busy intervals
    (merged), in microseconds on the host's clock (Kineto's ``baseTimeNanoseconds`` added, so
    that traces of several processes line up)."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    collectives: dict[str, list[Interval]] = collections.defaultdict(list)
    compute: list[Interval] = []
    for e in gpu_events(trace):
        interval = (base + e["ts"], base + e["ts"] + e["dur"])
        if is_nccl_kernel(e):
            collectives[e["name"].split("(")[0]].append(interval)
        else:
            compute.append(interval)
    for intervals in collectives.values():
        intervals.sort()
    return collectives, union(compute)


def skew(traces: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per NCCL kernel name: matched collectives, per rank the milliseconds it waited for others
    and how often it came last, and of the last ranks' lateness how much their compute stream
    was busy (GPU work) against idle (the host behind)."""
    ranks = [_kernels(t) for t in traces]
    names = sorted(set.intersection(*(set(collectives) for collectives, _ in ranks)))
    out: dict[str, Any] = {}
    ms = 1e-3 / steps
    for name in names:
        lists = [collectives[name] for collectives, _ in ranks]
        matched = min(map(len, lists))
        waited = [0.0] * len(ranks)
        last = [0] * len(ranks)
        late_busy = late_idle = 0.0
        for i in range(matched):
            starts = [intervals[i][0] for intervals in lists]
            latest = max(range(len(ranks)), key=lambda r: starts[r])
            first = min(starts)
            last[latest] += 1
            for r, s in enumerate(starts):
                waited[r] += starts[latest] - s
            busy = overlap(ranks[latest][1], [(first, starts[latest])])
            late_busy += busy
            late_idle += starts[latest] - first - busy
        out[name] = {
            "matched": matched,
            "unmatched": max(map(len, lists)) - matched,  # ranks launched different numbers
            "waited_ms": [w * ms for w in waited],
            "last_count": last,
            "late_gpu_busy_ms": late_busy * ms,
            "late_gpu_idle_ms": late_idle * ms,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, nargs="+", help="one trace per rank, rank order")
    parser.add_argument("--steps", type=int, default=2, help="steps the traces hold")
    args = parser.parse_args()
    if len(args.traces) < 2:
        parser.error("give every rank's trace (at least two)")
    print(json.dumps(skew([load(p) for p in args.traces], args.steps), indent=1))


if __name__ == "__main__":
    main()
