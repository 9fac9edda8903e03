"""A run's record: its files (resolved config, plugin versions), the iteration and evaluation
lines, and the records they make. Rank 0 writes; every rank joins the reductions of what is
logged. The sinks that store the records (``metrics.jsonl``, TensorBoard, W&B) are a built-in
plugin on the lifecycle hooks (``mega.plugins.lifecycle.metrics_sinks``): an iteration line's
record is the ``metrics`` of its ``step_end``; the others (evaluations) wait in ``records``."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from mega.core.checkpoint.store import atomic_write_text
from mega.core.config.resolve import resolved_as_dict
from mega.core.config.run_files import plugins_txt, to_toml
from mega.core.config.sections import RunConfig
from mega.core.console.display import Display
from mega.core.console.metrics import (
    IntervalStats,
    format_eval_line,
    format_iteration_line,
    metric_key,
)
from mega.parallel import comm
from mega.parallel.topology import Topology


class RunLog:
    def __init__(
        self,
        config: RunConfig,
        topology: Topology,
        device: torch.device,
        display: Display,
        flops_per_token: float,
        loss_names: tuple[str, ...] = ("lm loss",),
    ) -> None:
        self.config, self.topology, self.device = config, topology, device
        self.display, self.flops_per_token = display, flops_per_token
        self.loss_names = loss_names
        # rank 0, once open: the records the sinks have not taken yet (``take_records``)
        self.records: list[dict[str, Any]] | None = None
        self.start_iteration = 0  # where training started: a loaded checkpoint's iteration
        c = config
        run_dir = c.logging.run_dir or c.checkpoint.save
        if not run_dir:
            # one directory for the whole job: each rank's clock could name another second
            # (rank 0 creates it; a rank that wrote into its own name found no directory there)
            run_dir = f"runs/{c.model_name}-{comm.from_rank0(time.strftime('%Y%m%d-%H%M%S'))}"
        self.run_dir = Path(run_dir)

    def startup_panel(self, num_parameters: int) -> None:
        """The run's summary before the first step: model, data, batch, layout, directory."""
        cfg, t = self.config, self.config.training
        self.display.panel(
            "mega",
            [
                f"model {cfg.model_name}: {num_parameters:,} parameters,"
                f" {cfg.precision.params_dtype}",
                f"data {cfg.dataset_name}, tokenizer {cfg.tokenizer_name}, seq {t.seq_length}",
                f"global batch {cfg.global_batch_size} = {cfg.num_microbatches} micro-batches x"
                f" {t.micro_batch_size}",
                f"{self.topology.describe()} on {device_text(self.device)},"
                f" schedule {cfg.parallel.parallel}",
                f"run directory {self.run_dir}",
            ],
        )

    def open(self, plugins: Any, iteration: int = 0) -> None:
        """Write the resolved config and plugin versions, and start keeping records (rank 0).
        ``iteration``: where training starts (a loaded checkpoint's)."""
        cfg = self.config
        self.start_iteration = iteration
        if not self.topology.is_rank0:  # one writer of the run's files: rank 0
            return
        for directory in {self.run_dir, Path(cfg.checkpoint.save or self.run_dir)}:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_text(directory / "config.resolved.toml", to_toml(resolved_as_dict(cfg)))
            atomic_write_text(directory / "plugins.txt", plugins_txt(plugins))
        self.records = []

    def write(self, record: dict[str, Any]) -> None:
        """A record for the sinks that is no iteration line's (an evaluation's): they take it
        at the next ``step_end``, ``checkpoint_saved`` or ``shutdown``."""
        if self.records is not None:
            self.records.append(record)

    def take_records(self) -> list[dict[str, Any]]:
        """The records written since the last call, oldest first (none before ``open`` and on
        ranks other than 0)."""
        if not self.records:
            return []
        taken, self.records = self.records, []
        return taken

    def dp_mean(self, values: list[torch.Tensor]) -> list[Any]:
        """Per-rank loss means -> their mean over the data-parallel ranks, synced to the host
        (a float per scalar, a list per vector of loss parts). Only the last pipeline stage has
        losses (the others hold zeros): summed over the stages."""
        if not values:
            return []
        stacked = torch.stack(values).float()
        comm.all_reduce(stacked, self.topology.group("pp"))
        group = self.topology.group("dp")
        if group is not None:
            comm.all_reduce(stacked, group)
            stacked /= self.topology.data_parallel_size
        return stacked.tolist()

    def _peak_memory_gb_by_rank(self) -> list[float]:
        """Each rank's peak of allocated GPU memory so far, in GiB, by global rank (pipeline
        stages and the rank holding the output layer differ)."""
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], device=self.device)
        if self.topology.world_size > 1:
            import torch.distributed as dist

            peaks = peak.new_empty(self.topology.world_size)
            dist.all_gather_into_tensor(peaks, peak)
            peak = peaks
        return [round(float(x) / 2**30, 3) for x in peak.tolist()]

    def iteration_line(
        self,
        interval: IntervalStats,
        result: Any,
        progress: dict[str, int],
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, float], int]:
        """Sync the interval's losses once and print the iteration line.
        ``progress`` holds iteration, consumed_samples, skipped_total and nan_total (before this
        interval's NaNs); ``extra``: more metrics (the MoE routers'). Returns the line's metrics
        and the interval's NaN iterations."""
        cfg, t = self.config, self.config.training
        elapsed_ms = interval.elapsed_ms_per_iteration()
        # one [parts] row per applied step
        losses = [_row(x) for x in self.dp_mean(interval.losses)]
        finite = [row for row in losses if all(math.isfinite(x) for x in row)]
        # Megatron counts a NaN iteration when a *skipped* step's loss was inf or NaN
        skipped = [_row(x) for x in self.dp_mean(interval.skipped_losses)]
        nan_count = sum(not all(math.isfinite(x) for x in row) for row in skipped)
        gbs = progress.get("global_batch_size", cfg.global_batch_size)  # ramps with a ramp
        tokens_per_s = gbs * t.seq_length / (elapsed_ms / 1000.0)
        metrics: dict[str, float] = {
            "iteration": progress["iteration"],
            "consumed_samples": progress["consumed_samples"],
            "elapsed_ms": elapsed_ms,
            "learning_rate": result.learning_rate,
            "global_batch_size": gbs,
            "loss_scale": result.loss_scale,
            "skipped_iterations": interval.skipped,
            "nan_iterations": nan_count,
            "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tokens_per_s * self.flops_per_token / 1e12 / self.topology.world_size,
        }
        if finite:  # each part's mean over the interval: lm_loss, sop_loss...
            for k, name in enumerate(self.loss_names):
                metrics[metric_key(name)] = sum(row[k] for row in finite) / len(finite)
        if interval.grad_norm is not None:
            metrics["grad_norm"] = float(interval.grad_norm)
        metrics.update(extra or {})
        if self.device.type == "cuda":
            by_rank = self._peak_memory_gb_by_rank()
            metrics["max_memory_gb"] = max(by_rank)
            metrics["max_memory_gb_by_rank"] = by_rank
        self.display.print(format_iteration_line(metrics, cfg.train_iters, self.loss_names))
        return metrics, nan_count

    def evaluation_line(self, label: str, losses: dict[str, float], iteration: int) -> None:
        """``losses``: each loss part's mean, by name (``{"lm loss": 2.3}``)."""
        self.display.print(format_eval_line(label, losses))
        split = "test" if label.startswith("test") else "valid"
        record = {f"{split}_{metric_key(name)}": value for name, value in losses.items()}
        self.write({"iteration": iteration, **record})


def _row(value: Any) -> list[float]:
    return value if isinstance(value, list) else [value]


def device_text(device: torch.device) -> str:
    """``cuda:0``, or ``cpu (2 CPU threads)``: on the CPU the thread count changes the bits."""
    if device.type != "cpu":
        return str(device)
    threads = torch.get_num_threads()
    return f"cpu ({threads} CPU thread{'s' if threads != 1 else ''})"
