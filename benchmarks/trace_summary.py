"""Where a rank's step went, from a Chrome trace of torch.profiler (``MEGA_RANK_PROFILE_TRACE=1``
of benchmarks/plugins/rank_profile.py writes one):

    python benchmarks/trace_summary.py DIR/tp2-sp-world2/trace_rank0.json[.gz] [--steps 2]

Per step: the GPU's span; the time some compute kernel runs, some NCCL kernel runs, both at once,
and neither (idle: the GPU waits for the host, when the host is behind); per stream its kernels
and busy time; the NCCL kernels by name. On 4 H100 it showed a compiled TP2 + SP step idle for
half its span (docs/performance.md, "Why TP was slow at micro-batch 4"). With ``--host-ops N``
also the host's N costliest ops per step, inclusive and self (``host_ops``): where the time of a
host-bound step goes (a CP4 rank's ring calls, ``cp4_fake_16k_2026-11-29``); with ``--callers OP``
the host ops around each call of OP (``callers``: which graph or node calls ``aten::item``);
with ``--kernels N`` the N costliest compute kernels per step (``kernels``: what one layout adds
over another).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged where they overlap, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def total(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(x: list[Interval], y: list[Interval]) -> float:
    """The time two merged interval lists share."""
    i = j = 0
    shared = 0.0
    while i < len(x) and j < len(y):
        shared += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return shared


def load(path: Path) -> dict[str, Any]:
    """A Chrome trace, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def gpu_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's GPU kernels, copies and fills."""
    categories = ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in categories]


def is_nccl_kernel(event: dict[str, Any]) -> bool:
    return "nccl" in event["name"].lower()


def summarize(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Milliseconds per step (see the module docstring)."""
    kernels = gpu_events(trace)
    if not kernels:
        raise SystemExit("no GPU kernels in this trace (a CPU run, or CUDA activity not recorded)")
    is_nccl = [is_nccl_kernel(e) for e in kernels]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    compute = union([iv for iv, n in zip(spans, is_nccl, strict=True) if not n])
    nccl = union([iv for iv, n in zip(spans, is_nccl, strict=True) if n])
    streams: dict[Any, list[Interval]] = collections.defaultdict(list)
    counts: collections.Counter = collections.Counter()
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event, interval, n in zip(kernels, spans, is_nccl, strict=True):
        streams[event["tid"]].append(interval)
        counts[event["tid"]] += 1
        if n:
            name = event["name"].split("(")[0]
            by_name[name][0] += 1
            by_name[name][1] += event["dur"]
    ms = 1e-3 / steps
    return {
        "gpu_span_ms": span * ms,
        "compute_busy_ms": total(compute) * ms,
        "nccl_busy_ms": total(nccl) * ms,
        "nccl_beside_compute_ms": overlap(compute, nccl) * ms,
        "idle_ms": (span - total(union(compute + nccl))) * ms,
        "streams": {
            str(tid): {"kernels": counts[tid] // steps, "busy_ms": total(union(iv)) * ms}
            for tid, iv in streams.items()
        },
        "nccl_kernels": {
            name: {"per_step": c // steps, "ms": d * ms, "mean_us": d / c}
            for name, (c, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])
        },
    }


HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")


def _nested(trace: dict[str, Any]) -> Iterator[tuple[dict, list[dict]]]:
    """Every host op with the ops enclosing it on its thread (outermost first), in time order."""
    by_thread: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            by_thread[e["pid"], e["tid"]].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []  # the ops enclosing the current one, innermost last
        for e in events:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            yield e, list(stack)
            stack.append(e)


def host_ops(trace: dict[str, Any], steps: int, top: int = 25) -> dict[str, Any]:
    """The host's side: per op name (a custom op such as ``mega::ring_attention_forward``, an
    aten op, a compiled graph's call), its calls per step and milliseconds per step, inclusive
    (with the ops it calls) and self (without them: the Python and dispatch around them), the
    ``top`` by inclusive time. The profiler's own cost per op inflates these where a step is
    host-bound (~1.4x for a CP4 rank, ``cp4_fake_16k_2026-11-29``)."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e, stack in _nested(trace):
        inclusive[e["name"]] += e["dur"]
        own[e["name"]] += e["dur"]
        calls[e["name"]] += 1
        if stack:
            own[stack[-1]["name"]] -= e["dur"]
    ms = 1e-3 / steps
    return {
        name: {
            "per_step": calls[name] / steps,
            "inclusive_ms": inclusive[name] * ms,
            "self_ms": own[name] * ms,
        }
        for name, _ in inclusive.most_common(top)
    }


def callers(trace: dict[str, Any], op: str, steps: int, depth: int = 3) -> dict[str, Any]:
    """Where the host calls ``op`` (say ``aten::item``, a sync): per chain of the ``depth`` ops
    enclosing it (innermost first, `` <- ``), its calls and milliseconds per step. A trace
    without Python stacks still names the compiled graph, autograd node or custom op around
    each call."""
    found: collections.Counter = collections.Counter()
    time: collections.Counter = collections.Counter()
    for e, stack in _nested(trace):
        if e["name"] == op:
            chain = " <- ".join(o["name"][:80] for o in stack[::-1][:depth]) or "(top level)"
            found[chain] += 1
            time[chain] += e["dur"]
    return {
        chain: {"per_step": n / steps, "ms": time[chain] * 1e-3 / steps}
        for chain, n in found.most_common()
    }


def compute_kernels(trace: dict[str, Any], steps: int, top: int = 20) -> dict[str, Any]:
    """The GPU's non-NCCL kernels and copies by name (cut at 90 characters), the ``top`` by time:
    calls and milliseconds per step. Where two layouts do the same FLOPs, the kernels one of them
    adds (padding, copies, a slower GEMM) show here."""
    calls: collections.Counter = collections.Counter()
    time: collections.Counter = collections.Counter()
    for e in gpu_events(trace):
        if not is_nccl_kernel(e):
            calls[e["name"][:90]] += 1
            time[e["name"][:90]] += e["dur"]
    return {
        name: {"per_step": calls[name] / steps, "ms": t * 1e-3 / steps}
        for name, t in time.most_common(top)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    parser.add_argument(
        "--host-ops", type=int, default=0, metavar="N", help="also the N costliest host ops"
    )
    parser.add_argument(
        "--callers", default="", metavar="OP", help="also the host ops around each call of OP"
    )
    parser.add_argument(
        "--kernels", type=int, default=0, metavar="N", help="also the N costliest compute kernels"
    )
    args = parser.parse_args()
    trace = load(args.trace)
    summary = summarize(trace, args.steps)
    if args.host_ops:
        summary["host_ops"] = host_ops(trace, args.steps, args.host_ops)
    if args.callers:
        summary["callers"] = callers(trace, args.callers, args.steps)
    if args.kernels:
        summary["kernels"] = compute_kernels(trace, args.steps, args.kernels)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
