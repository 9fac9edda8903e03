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
over another); with ``--stretches N`` where the compute stream idles (``idle_stretches``: the
runs of short kernels between long ones, by their first kernel, the N that idle most: profiled, the MoE
DP2 rank of session 56 idled 7.3 ms a step in its 52 routing runs of ~23 kernels, and 12.2 in
the runs after its optimizer, where the log line's sync leaves the GPU waiting for the host).
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


def idle_stretches(
    trace: dict[str, Any], steps: int, top: int = 10, long_us: float = 100.0
) -> dict[str, Any]:
    """Where the busiest compute stream waits: its kernels split into runs of short ones (each
    under ``long_us``) between long ones (GEMMs, attention); each run's idle time (its gaps and
    the gap before the long kernel that ends it) is the host's lateness there. By the run's
    first kernel (cut at 60 characters), the ``top`` by idle time: runs, kernels per run, busy
    and idle milliseconds per step. A step planned GPU-bound over its whole pass can still idle
    in runs of small kernels whose launches take longer than they run."""
    events = [e for e in gpu_events(trace) if not is_nccl_kernel(e)]
    if not events:
        return {}
    stream = collections.Counter(e["tid"] for e in events).most_common(1)[0][0]
    kernels = sorted((e for e in events if e["tid"] == stream), key=lambda e: e["ts"])
    runs: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    run, end = None, kernels[0]["ts"]
    for e in kernels:
        gap = max(0.0, e["ts"] - end)
        if e["dur"] >= long_us:  # a long kernel ends the run; the wait before it is the run's
            if run is not None:
                runs[run][3] += gap
            run = None
        else:
            if run is None:
                run = e["name"][:60]
                runs[run][0] += 1
            runs[run][1] += 1
            runs[run][2] += e["dur"]
            runs[run][3] += gap
        end = max(end, e["ts"] + e["dur"])
    ranked = sorted(runs.items(), key=lambda kv: -kv[1][3])[:top]
    return {
        name: {
            "per_step": count / steps,
            "kernels_per_run": kernels_in / count,
            "busy_ms": busy * 1e-3 / steps,
            "idle_ms": idle * 1e-3 / steps,
        }
        for name, (count, kernels_in, busy, idle) in ranked
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
    parser.add_argument(
        "--stretches", type=int, default=0, metavar="N",
        help="also the N runs of short kernels where the compute stream idles most",
    )  # fmt: skip
    args = parser.parse_args()
    trace = load(args.trace)
    summary = summarize(trace, args.steps)
    if args.host_ops:
        summary["host_ops"] = host_ops(trace, args.steps, args.host_ops)
    if args.callers:
        summary["callers"] = callers(trace, args.callers, args.steps)
    if args.kernels:
        summary["kernels"] = compute_kernels(trace, args.steps, args.kernels)
    if args.stretches:
        summary["idle_stretches"] = idle_stretches(trace, args.steps, args.stretches)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
