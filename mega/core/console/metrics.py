"""The iteration line Megatron users read, and the sinks that record the same metrics.

Losses stay on the device between logging iterations; they are read (one host sync) only when a
line is printed, so logging does not slow every step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class IntervalStats:
    """What happened since the last iteration line (Megatron reports per-interval counts)."""

    started: float = field(default_factory=time.perf_counter)
    excluded: float = 0.0  # seconds spent in evaluation and saving: not training time
    iterations: int = 0
    losses: list[Any] = field(default_factory=list)  # device tensors of applied steps
    skipped_losses: list[Any] = field(default_factory=list)  # of steps the loss scaler skipped
    grad_norm: Any = None

    @property
    def skipped(self) -> int:
        return len(self.skipped_losses)

    def add(self, result: Any) -> None:
        """One step's ``StepResult``: its loss joins the applied or the skipped ones."""
        self.iterations += 1
        if result.skipped:
            self.skipped_losses.append(result.loss)
        else:
            self.losses.append(result.loss)
            self.grad_norm = result.grad_norm

    def elapsed_ms_per_iteration(self) -> float:
        elapsed = time.perf_counter() - self.started - self.excluded
        return elapsed * 1000.0 / max(self.iterations, 1)

    def state_dict(self) -> dict[str, Any]:
        """Losses as floats: a checkpoint mid-interval resumes to print the same averages."""
        # a float per step, or a list of them for a model with several loss parts
        as_floats = lambda xs: [x.tolist() if x.numel() > 1 else float(x) for x in xs]  # noqa: E731
        return {
            "iterations": self.iterations,
            "losses": as_floats(self.losses),
            "skipped_losses": as_floats(self.skipped_losses),
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> IntervalStats:
        import torch

        return cls(
            iterations=int(state["iterations"]),
            losses=[torch.tensor(x).reshape(-1) for x in state["losses"]],
            skipped_losses=[torch.tensor(x).reshape(-1) for x in state["skipped_losses"]],
            grad_norm=state["grad_norm"],
        )


def metric_key(loss_name: str) -> str:
    """A loss part's key in the metrics records: ``lm loss`` -> ``lm_loss``."""
    return loss_name.replace(" ", "_")


def format_iteration_line(
    m: dict[str, float], train_iters: int, loss_names: tuple[str, ...] = ("lm loss",)
) -> str:
    """Megatron's training_log line, plus tokens/s; each loss part as ``lm loss: 1.086954E+01``."""
    parts = [
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {int(m['iteration']):8d}/{train_iters:8d}",
        f"consumed samples: {int(m['consumed_samples']):12d}",
        f"elapsed time per iteration (ms): {m['elapsed_ms']:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {m['tflops_per_gpu']:.1f}",
        f"tokens per second: {m['tokens_per_s']:.0f}",
        f"learning rate: {m['learning_rate']:.6E}",
        f"global batch size: {int(m['global_batch_size']):5d}",
    ]
    for name in loss_names:
        if metric_key(name) in m:
            parts.append(f"{name}: {m[metric_key(name)]:.6E}")
    for key in ("load_balancing_loss", "z_loss"):  # MoE routers, under Megatron's names
        if key in m:
            parts.append(f"{key}: {m[key]:.6E}")
    if "dropped_token_fraction" in m:
        parts.append(f"dropped tokens: {100 * m['dropped_token_fraction']:.2f}%")
    parts.append(f"loss scale: {m['loss_scale']:.1f}")
    if "grad_norm" in m:
        parts.append(f"grad norm: {m['grad_norm']:.3f}")
    parts.append(f"number of skipped iterations: {int(m['skipped_iterations']):3d}")
    parts.append(f"number of nan iterations: {int(m['nan_iterations']):3d}")
    if "max_memory_gb" in m:  # GPU runs: the largest peak over all ranks
        parts.append(f"max memory allocated (GB): {m['max_memory_gb']:.2f}")
    return " | ".join(parts) + " |"


def format_eval_line(label: str, losses: dict[str, float]) -> str:
    """Megatron's evaluation line: each loss part's value and perplexity."""
    import math

    parts = [f" {label}"]
    for name, loss in losses.items():
        ppl = math.exp(min(20.0, loss))
        parts.append(f"{name} value: {loss:.6E} | {name} PPL: {ppl:.6E}")
    return " | ".join(parts) + " |"


class JsonlSink:
    """``metrics.jsonl`` in the run directory: one JSON object per iteration line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # line-buffered: a crash loses no whole line

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under Megatron's tag names, through torch.utils.tensorboard."""

    TAGS = {
        "lm_loss": "lm loss",
        "learning_rate": "learning-rate",
        "loss_scale": "loss-scale",
        "grad_norm": "grad-norm",
        "tokens_per_s": "tokens-per-second",
        "tflops_per_gpu": "throughput",
        "global_batch_size": "batch-size",
        "load_balancing_loss": "load_balancing_loss",
        "z_loss": "z_loss",
    }

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=directory)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["iteration"])
        for key, tag in self.TAGS.items():
            if key in record:
                self._writer.add_scalar(tag, record[key], step)
        if "valid_lm_loss" in record:
            self._writer.add_scalar("lm loss validation", record["valid_lm_loss"], step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
