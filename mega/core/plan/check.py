"""Every GPU run checks the planner: ``mega train`` plans itself beside the run and its first
iteration lines set the planned peak memory against the measured one.

The planner needs a process without a process group (it builds the run under a fake one), so rank
0 starts it as a child process (``python -m mega.core.plan.check``), handing it the resolved
config. The child sees no GPU (``CUDA_VISIBLE_DEVICES`` empty: a CUDA context would cost the run
memory), runs at a lower priority on one thread, and prints one JSON line: the planned peak of
every pipeline stage and the step estimate, or the error that stopped it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

GIB = 2**30
# the job's variables: the child is no rank of it
_JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


@dataclass(frozen=True)
class PlannedRun:
    """What the planner said about a run: every stage's peak (GiB, by pipeline stage), and its
    tokens/s; or ``error``, why it could not plan it."""

    peak_gib_by_stage: tuple[float, ...] = ()
    tokens_per_s: float = 0.0
    error: str = ""

    @property
    def peak_gib(self) -> float:
        return max(self.peak_gib_by_stage)

    def memory_line(self, measured_gib: float) -> str:
        """The console line that sets ``measured_gib`` (the largest rank's peak) against it."""
        if self.error:
            return f" > mega plan could not count this run: {self.error}"
        off = 100 * (self.peak_gib / measured_gib - 1)
        return (
            f" > peak memory per GPU (largest rank): measured {measured_gib:.2f} GiB,"
            f" planned {self.peak_gib:.2f} GiB by mega plan ({off:+.1f}%)"
        )


def gpu_kind(device_name: str) -> str | None:
    """The planner's GPU kind of a CUDA device name (``NVIDIA H100 80GB HBM3``: ``h100``)."""
    from mega.core.plan.calibration import GPU_MEMORY_GIB

    words = device_name.lower().replace("-", " ").split()
    return next((kind for kind in GPU_MEMORY_GIB if kind in words), None)


def start_plan_check(config: Any, device: Any) -> PlanCheck | None:
    """The planner started beside a run on ``device`` (a ``torch.device``); None on the CPU,
    where there is no GPU memory to set the plan against."""
    if device.type != "cuda":
        return None
    import torch

    return PlanCheck(config, gpu_kind(torch.cuda.get_device_name(device)))


class PlanCheck:
    """The planner running beside this run (see the module docstring)."""

    def __init__(self, config: Any, kind: str | None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mega.core.plan.check"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps((config, kind)))
        self._proc.stdin.close()
        self._result: PlannedRun | None = None

    def result(self, wait_s: float = 0.0) -> PlannedRun | None:
        """The plan, once the child has finished (waiting up to ``wait_s``); None before."""
        if self._result is None:
            try:
                self._proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                return None
            assert self._proc.stdout is not None
            self._result = _parse(self._proc.stdout.read().decode(errors="replace"))
        return self._result

    def stop(self) -> None:
        """End the child if it is still counting (the run ended first)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _parse(output: str) -> PlannedRun:
    lines = output.strip().splitlines()
    try:
        fields = json.loads(lines[-1])
    except (IndexError, ValueError):
        return PlannedRun(error="the planner ended without a result")
    return PlannedRun(
        tuple(fields.get("peak_gib_by_stage", ())),
        fields.get("tokens_per_s", 0.0),
        fields.get("error", ""),
    )


def _plan_from_stdin() -> dict[str, Any]:
    config, kind = pickle.loads(sys.stdin.buffer.read())
    try:
        os.nice(10)  # the run comes first
    except OSError:
        pass
    from mega.core.plan.calibration import BUILT_IN, rates_for
    from mega.core.plan.estimate import plan_run
    from mega.core.plugins.manager import make_plugins
    from mega.errors import MegaUsageError

    try:
        # memory needs no rates; a kind without built-in ones plans with the default's
        plan = plan_run(config, make_plugins(), rates_for(kind if kind in BUILT_IN else None))
    except MegaUsageError as exc:
        return {"error": "; ".join(exc.messages)}
    except Exception as exc:  # noqa: BLE001 - whatever stops the plan is what the line says
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "peak_gib_by_stage": [stage.profile.peak_bytes / GIB for stage in plan.stages],
        "tokens_per_s": plan.tokens_per_second,
    }


if __name__ == "__main__":
    print(json.dumps(_plan_from_stdin()), flush=True)
