"""A plugin that profiles two steps of every rank of a multi-GPU ``mega train``: load it with
``MEGA_PLUGINS_DIR=benchmarks/plugins MEGA_RANK_PROFILE=DIR`` (``MEGA_RANK_PROFILE_AT=N``: after
iteration N, default 10).

Each rank writes ``DIR/<layout>/kernels_rank<R>.txt`` (``<layout>`` from the run's sizes, e.g.
``tp2-dp1-sp``): device time per step by category (GEMM, attention,
optimizer, communication: NCCL's kernels, on their own streams, so their time overlaps compute
where it is hidden; other), the busy time of the compute stream(s) against the step's span, and
the most expensive kernels (``gpt_throughput.kernel_table``). With ``MEGA_RANK_PROFILE_TRACE=1``
rank 0 also writes a Chrome trace, ``trace_rank0.json``, with the host's side (where the GPU
waits for the host); with ``MEGA_RANK_PROFILE_TRACE=all`` every rank writes its
``trace_rank<R>.json`` (whose trips wait for whom: the ranks side by side).
``MEGA_RANK_PROFILE_CPU=0`` records the GPU's side alone: the host-side recording lengthens a
host-bound step (a MoE DP2 rank of issue 46 on one H200: 198.6 ms a step profiled with it, 171.0
unprofiled), and the GPU's idle time with it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from mega import hookimpl

STEPS = 2


def trace_wanted(setting: str | None, rank: int) -> bool:
    """Whether this rank writes its Chrome trace: ``1`` rank 0's, ``all`` every rank's."""
    return setting == "all" or (setting == "1" and rank == 0)


class _RankProfile:
    def __init__(self) -> None:
        self.at = int(os.environ.get("MEGA_RANK_PROFILE_AT", "10"))
        self.profiler: Any = None
        self.started = 0.0

    def step_end(self, engine: Any, iteration: int, metrics: dict[str, float]) -> None:
        import torch

        out = os.environ.get("MEGA_RANK_PROFILE")
        if not out:
            return
        cpu = os.environ.get("MEGA_RANK_PROFILE_CPU", "1")
        if cpu not in ("0", "1"):  # checked before the GPU: a typo must not profile silently
            raise ValueError(f"MEGA_RANK_PROFILE_CPU={cpu!r}: 0 (GPU only) or 1 (GPU and host)")
        if not torch.cuda.is_available():
            return
        if iteration == self.at:
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if cpu == "1":
                activities.append(torch.profiler.ProfilerActivity.CPU)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            self.started = time.perf_counter()
        elif iteration == self.at + STEPS and self.profiler is not None:
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self.started) * 1e3 / STEPS
            self.profiler.stop()
            sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/: gpt_throughput
            from gpt_throughput import kernel_table

            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            p = engine.config.parallel
            sizes = {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size}
            sizes |= {"cp": p.context_parallel_size, "ep": p.expert_model_parallel_size}
            layout = "-".join(f"{k}{v}" for k, v in sizes.items() if v > 1) or "single"
            layout += "-sp" if p.sequence_parallel else ""
            layout += "-eager" if engine.config.training.compile is False else ""
            out = Path(out, f"{layout}-world{engine.topology.world_size}")
            out.mkdir(parents=True, exist_ok=True)
            table = kernel_table(self.profiler, STEPS)
            head = f"rank {rank}: {wall_ms:.1f} ms per step (host clock, profiled)\n"
            Path(out, f"kernels_rank{rank}.txt").write_text(head + table + "\n")
            if trace_wanted(os.environ.get("MEGA_RANK_PROFILE_TRACE"), rank):
                self.profiler.export_chrome_trace(str(Path(out, f"trace_rank{rank}.json")))
            self.profiler = None

    def shutdown(self) -> None:
        """A run that ends inside the profiled steps (``--train-iters`` below
        ``MEGA_RANK_PROFILE_AT + 2``) stops its profiler here, saying so: left running to the
        process's exit, it aborted an EP4 rank with "double free or corruption" (2026-11-29)."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.profiler = None
        print(
            f"rank_profile: the run ended before iteration {self.at + STEPS}, the end of the"
            f" profiled steps (MEGA_RANK_PROFILE_AT={self.at}); nothing written",
            file=sys.stderr,
            flush=True,
        )


_profile = _RankProfile()


@hookimpl
def step_end(engine: Any, iteration: int, metrics: dict[str, float]) -> None:
    _profile.step_end(engine, iteration, metrics)


@hookimpl
def shutdown(engine: Any, exc: BaseException | None) -> None:
    _profile.shutdown()
