"""The GPU's milliseconds for one call of a step, for the kernel benchmarks (swiglu_rows.py,
grad_accumulation.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def gpu_ms(step: Callable[[], object], iters: int, warmup: int, repeats: int = 5) -> float:
    """Milliseconds of one ``step()``: ``iters`` calls back to back between two CUDA events (the
    GPU's time, not the host's: a synchronize after each call would time its launches), the
    median of ``repeats`` such runs, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        step()
    runs = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        stop.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(stop) / iters)
    return statistics.median(runs)
