"""The training loop: join the job, build the run's parts, then step, log, evaluate and save.

plugins = make_plugins()
config = resolve_config(["--model", "gpt", "--train-iters", "100"], plugins)
Engine(config, plugins).train()

Every step goes through the run's schedule table (``no-pipelining`` is the one-stage table), run
by the one executor: there is one step path whatever the layout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from mega._deprecated import moved
from mega.core.config.sections import RunConfig
from mega.core.console.display import Display
from mega.core.console.metrics import IntervalStats
from mega.core.console.run_log import RunLog
from mega.core.plugins.hookspecs import hookimpl
from mega.core.plugins.manager import Plugins
from mega.core.schedules.samples import batch_schedule, schedule_increment
from mega.core.training.batches import BatchPrefetcher, global_batch
from mega.core.training.build import build_run
from mega.core.training.cpu_math import warm_up_vector_math
from mega.core.training.evaluation import Evaluation
from mega.core.training.exit_conditions import ExitConditions
from mega.core.training.interrupt import interrupted_message
from mega.core.training.rng import seed_everything
from mega.core.training.run_state import (
    finish_pending_save,
    load_run,
    prepare_async_save,
    save_run,
)
from mega.core.training.step import StepResult
from mega.errors import MegaRunError
from mega.parallel.dimensions import extra_joins, run_dimensions
from mega.parallel.distributed import join_job
from mega.parallel.topology import Topology

# moved to mega.core.training.evaluation with the rest of evaluation (2026-11-27)
__getattr__ = moved(
    __name__, "mega.core.training.evaluation", ["last_evaluation_batch"], since="2026-11-27"
)


class CoreHooks:
    """The engine's own hook implementations; plugins wrap them."""

    @hookimpl(trylast=True)
    def train_step(self, engine: Engine, microbatches: list, iteration: int) -> StepResult:
        return engine.run_step(microbatches, iteration)


class Engine(Evaluation):
    """One training run. ``train()`` builds everything (``setup``) and runs the loop."""

    def __init__(self, config: RunConfig, plugins: Plugins, display: Display | None = None):
        self.config = config
        self.plugins = plugins
        self.display = display or Display()
        self.topology = Topology()
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped_total = 0
        self.nan_total = 0
        # the LR schedule's count: successful steps, or their samples with --train-samples
        self.scheduler_steps = 0
        self.batches = batch_schedule(config)  # each step's global batch (--rampup-batch-size)
        # the iteration of the newest checkpoint written or loaded
        self.last_saved: int | None = None
        self._previous_gbs: int | None = None  # the last step's global batch (a ramp changes it)
        self.pending_save: Any = None  # an --async-save checkpoint still being written
        self.host_copy: Any = None  # --async-save's host buffer, kept between saves
        self.interval = IntervalStats()  # what the next iteration line will summarise
        self.fp8_scaling: Any = None  # --fp8-recipe delayed (set up by setup())
        if not plugins.pm.has_plugin("mega-core"):
            plugins.pm.register(CoreHooks(), name="mega-core")

    # for plugins (docs/plugins.md): after setup, the model's padded vocabulary and its
    # parameter count as printed at startup (the whole model's, without padding rows)
    padded_vocab = property(lambda self: self.parts.padded_vocab)
    num_parameters = property(lambda self: self.parts.num_parameters)

    def setup(self) -> None:
        cfg, t = self.config, self.config.training
        self.device, self.topology = join_job(cfg, extra_joins(cfg.parallel, self.plugins.choices))
        if self.device.type == "cpu":
            warm_up_vector_math()  # before any multi-threaded first call (see cpu_math)
        if not self.topology.is_rank0:  # rank 0 owns the console; others warn with a prefix
            self.display = Display(enabled=False, rank=self.topology.rank)
        # Megatron offsets the seed per pipeline stage; init does not use it (weights are seeded
        # per parameter name), dropout and other runtime randomness do; so may a dimension
        # (context-parallel ranks hold other positions: their dropout masks must differ too)
        topo = self.topology
        offsets = (d.seed_offset(topo) for d in run_dimensions(topo, self.plugins.choices))
        seed_everything(t.seed + 100 * topo.pp_rank + sum(offsets))
        self.plugins.pm.hook.topology_ready(topology=self.topology, engine=self)
        self.parts = parts = build_run(cfg, self.plugins, self.topology, self.device, self.display)
        self.tokenizer, self.splits, self.model = parts.tokenizer, parts.splits, parts.model
        self.vocab_rows = parts.vocab_rows
        self.executor, self.buffer, self.optimizer = parts.executor, parts.buffer, parts.optimizer
        self.lr_schedule, self.flops_per_token = parts.lr_schedule, parts.flops_per_token
        self.loss_names = parts.loss_names
        self.fp8_scaling = parts.fp8_scaling
        self.prepare_microbatch = parts.prepare_microbatch
        self.log = RunLog(
            cfg, self.topology, self.device, self.display, parts.flops_per_token, self.loss_names
        )
        self.run_dir = self.log.run_dir
        if cfg.checkpoint.load:
            load_run(self, cfg.checkpoint.load)
        prepare_async_save(self)
        self.log.open(self.plugins, self.iteration)
        self.log.startup_panel(parts.num_parameters)

    # ------------------------------------------------------------------ one step

    def _schedule_step(self, microbatches: list) -> int:
        dp = self.topology.data_parallel_size
        return schedule_increment(self.config, len(microbatches), dp)

    def run_step(self, microbatches: list[dict[str, torch.Tensor]], iteration: int) -> StepResult:
        """Forward/backward over the global batch through the schedule, then the optimizer."""
        # Megatron's scheduler advances only on successful steps, and a step uses the LR it held
        # before stepping; the line logs the LR after this step, as Megatron's does.
        successful = self.scheduler_steps
        lr = self.lr_schedule.lr_at(successful)
        self.buffer.start_step(len(microbatches))
        losses = self.executor.forward_backward(microbatches, grad_scale=self.optimizer.loss_scale)
        self.buffer.finish_grad_sync()
        if self.pending_save is not None:  # its copies must read the values before the update
            self.pending_save.before_update()
        if self.fp8_scaling is not None:  # the next step casts with this step's amaxes
            self.fp8_scaling.update()
        outcome = self.optimizer.step(lr, iteration)
        return StepResult(
            loss=self._batch_loss(losses),
            skipped=outcome.skipped,
            grad_norm=outcome.grad_norm,
            learning_rate=self.lr_schedule.lr_at(
                successful + (0 if outcome.skipped else self._schedule_step(microbatches))
            ),
            loss_scale=self.optimizer.loss_scale,
        )

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float]:
        """Train to ``--train-iters``; returns the metrics of the last iteration line."""
        cfg, t = self.config, self.config.training
        gbs, hook = cfg.global_batch_size, self.plugins.pm.hook
        train_iters = cfg.train_iters  # --train-iters, or from --train-samples
        last: dict[str, float] = {}
        error: BaseException | None = None
        exits: ExitConditions | None = None
        stop: str | None = None
        try:
            self.setup()
            exits = ExitConditions(cfg.checkpoint, self.topology, self.device)
            self.display.start_progress(train_iters, self.iteration, "training")
            prefetch = BatchPrefetcher(t.num_workers, self.batches.micro_times_dp)
            train, build = self.splits.train, self._microbatches
            while self.iteration < train_iters:
                iteration = self.iteration + 1
                self.model.train()
                step_gbs = self.batches.at(self.consumed_samples)  # grows with a ramp
                self._save_if_microbatches_change(step_gbs)
                batch = prefetch.take(build, train, self.consumed_samples, step_gbs)
                if iteration < train_iters:  # the next step's batch while this one runs
                    following = self.consumed_samples + step_gbs
                    prefetch.ahead(build, train, following, self.batches.at(following))
                result = hook.train_step(engine=self, microbatches=batch, iteration=iteration)
                self.iteration, self.consumed_samples = iteration, self.consumed_samples + step_gbs
                self.interval.add(result)
                self.skipped_total += result.skipped
                if not result.skipped:
                    self.scheduler_steps += self._schedule_step(batch)
                metrics = {"iteration": iteration, "consumed_samples": self.consumed_samples}
                # iteration 1 too, so a run shows where its loss started
                if iteration % t.log_interval == 0 or iteration in (1, train_iters):
                    self._stop_if_nonfinite()  # the line syncs anyway
                    metrics.update(self._log_interval(result))
                    last = metrics
                hook.step_end(engine=self, iteration=iteration, metrics=metrics)
                self.display.advance(iteration, f"loss {last.get('lm_loss', float('nan')):.3f}")
                if (
                    self.splits.valid is not None
                    and t.eval_iters
                    and iteration % t.eval_interval == 0
                ):
                    first = (iteration // t.eval_interval - 1) * t.eval_iters * gbs
                    self._evaluate(
                        self.splits.valid, first, f"validation loss at iteration {iteration}"
                    )
                save_every = cfg.checkpoint.save_interval
                if cfg.checkpoint.save and save_every and iteration % save_every == 0:
                    self.save()
                stop = exits.reason(iteration) if iteration < train_iters else None
                if stop:
                    break
            prefetch.close()
            self._stop_if_nonfinite()
            if cfg.checkpoint.save and self.last_saved != self.iteration:
                self.save()
            finish_pending_save(self)
            self.display.stop_progress()
            if stop:  # as Megatron: saved, and no final evaluation
                self.display.print(f" exiting after iteration {self.iteration}: {stop}")
                return last
            self._final_evaluation()
        except KeyboardInterrupt as exc:  # Ctrl-C: say where it stopped and how to go on
            error = exc
            self.display.stop_progress()
            if self.display.enabled:
                print(interrupted_message(self), file=sys.stderr, flush=True)
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if exits is not None:
                exits.close()
            self.display.stop_progress()
            self._shut_down(error)
        return last

    def _shut_down(self, error: BaseException | None) -> None:
        """The ``shutdown`` hook, told of the error that ended the command (the built-in sinks
        close there, and the plan check ends: mega.plugins.lifecycle)."""
        self.plugins.pm.hook.shutdown(engine=self, exc=error)

    def _log_interval(self, result: StepResult) -> dict[str, float]:
        progress = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "skipped_total": self.skipped_total,
            "nan_total": self.nan_total,
            # the last step's (it differs from --global-batch-size during a ramp)
            "global_batch_size": self._previous_gbs or self.config.global_batch_size,
        }
        extra = {}  # each dimension's (MoE: load balancing, drops)
        for dimension in self.parts.dimensions:
            extra.update(dimension.metrics(self.model, self.topology))
        metrics, nan_count = self.log.iteration_line(self.interval, result, progress, extra)
        self.nan_total += nan_count
        self.interval = IntervalStats()
        return metrics

    def _stop_if_nonfinite(self) -> None:
        """Megatron's --check-for-nan-in-loss-and-grad. The optimizer skipped the update of any
        step whose gradients held NaN or inf; stop the run here, where the host syncs anyway."""
        bad = self.optimizer.first_nonfinite()
        if bad is not None:
            iteration, norm = bad
            raise MegaRunError(
                f"iteration {iteration}: NaN or inf in the gradients (the gradient norm is "
                f"{norm}); that update was not applied, and the run stopped at iteration "
                f"{self.iteration}. Lower --lr, or use --fp16 loss scaling to skip such steps"
            )

    def _save_if_microbatches_change(self, step_gbs: int) -> None:
        """Megatron saves a checkpoint (with --save) before a step whose number of micro-batches
        differs from the previous step's in this process, under --rampup-batch-size."""
        before, self._previous_gbs = self._previous_gbs or step_gbs, step_gbs
        save = self.config.checkpoint.save
        if before != step_gbs and self.iteration and save and self.last_saved != self.iteration:
            self.save()

    def _microbatches(
        self, source: Any, first_sample: int, batch_size: int | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """This data-parallel rank's share of the global batch starting at ``first_sample``
        (of ``batch_size`` samples: by default the batch of the step that starts there)."""
        t, topo = self.config.training, self.topology
        return global_batch(
            source,
            first_sample,
            batch_size if batch_size is not None else self.batches.at(first_sample),
            t.micro_batch_size,
            self.device,
            topo.dp_rank,
            topo.data_parallel_size,
            self.prepare_microbatch,
        )

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        self._stop_if_nonfinite()
        return save_run(self)
