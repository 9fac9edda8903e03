"""The training loop: build the pieces from plugins, then step, log, evaluate and save.

plugins = make_plugins()
config = resolve_config(["--model", "gpt", "--train-iters", "100"], plugins)
Engine(config, plugins).train()
"""

from __future__ import annotations

import inspect
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mega import BuildContext, DataRequest, hookimpl
from mega.core import comm
from mega.core.batches import global_batch, requested_samples
from mega.core.checkpointing import (
    atomic_write_text,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mega.core.compile import compile_model
from mega.core.config import RunConfig
from mega.core.console import Display
from mega.core.distributed import join_job
from mega.core.errors import MegaRunError, MegaUsageError
from mega.core.grad_buffer import ParamAndGradBuffer
from mega.core.lr_schedule import LRSchedule, resolve_warmup_iters
from mega.core.metrics import (
    IntervalStats,
    JsonlSink,
    TensorBoardSink,
    format_eval_line,
    format_iteration_line,
)
from mega.core.optimizer import MixedPrecisionAdamW
from mega.core.parallelize import parallelize
from mega.core.pipeline_setup import PipelineSetup, pipeline_setup
from mega.core.pipeline_split import tied_weights
from mega.core.plugins import Plugins
from mega.core.resolve import resolved_as_dict
from mega.core.resume_checks import check_schedule, data_changes
from mega.core.rng import capture_rng_state, restore_rng_state, seed_everything
from mega.core.run_files import plugins_txt, to_toml
from mega.core.topology import Topology
from mega.core.vocab import padded_vocab_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepResult:
    loss: torch.Tensor  # mean lm loss over the global batch (device tensor, not synced)
    skipped: bool  # fp16 overflow: the update was not applied
    grad_norm: torch.Tensor | None
    learning_rate: float
    loss_scale: float  # after this step's update of the scaler (what Megatron logs)


# Batch keys a model may take besides tokens and labels; passed when its forward accepts them.
OPTIONAL_INPUTS = ("position_ids", "attention_mask")


_ACCEPTED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def model_inputs(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The micro-batch's optional inputs that ``model.forward`` has parameters for."""
    accepted = _ACCEPTED.get(model)
    if accepted is None:  # read the signature once per model, not once per micro-batch
        parameters = inspect.signature(model.forward).parameters
        accepted = _ACCEPTED[model] = tuple(k for k in OPTIONAL_INPUTS if k in parameters)
    return {k: microbatch[k] for k in accepted if k in microbatch}


def model_forward(
    model: torch.nn.Module,
    microbatch: dict[str, torch.Tensor],
    hidden_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model (or a pipeline chunk) on one micro-batch: per-token loss, or hidden states from
    a pipeline stage before the last, which also gets the previous stage's ``hidden_states``."""
    extra = model_inputs(model, microbatch)
    if hidden_states is not None:
        extra["hidden_states"] = hidden_states
    return model(microbatch["tokens"], labels=microbatch["labels"], **extra)


def masked_mean(per_token: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss over the tokens the loss mask keeps (fp32 scalar)."""
    mask = microbatch["loss_mask"].to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def masked_lm_loss(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss of the whole model over the tokens the loss mask keeps."""
    return masked_mean(model_forward(model, microbatch), microbatch)


class CoreHooks:
    """The engine's own hook implementations; plugins wrap them."""

    @hookimpl(trylast=True)
    def train_step(self, engine: Engine, microbatches: list, iteration: int) -> StepResult:
        return engine.run_step(microbatches, iteration)


class Engine:
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
        self._sinks: list[Any] = []
        self.interval = IntervalStats()  # what the next iteration line will summarise
        if not plugins.pm.has_plugin("mega-core"):
            plugins.pm.register(CoreHooks(), name="mega-core")

    # ------------------------------------------------------------------ setup

    def _join_job(self) -> None:
        self.device, self.topology = join_job(self.config)
        if not self.topology.is_rank0:  # rank 0 owns the console; others warn with a prefix
            self.display = Display(enabled=False, rank=self.topology.rank)

    def setup(self) -> None:
        cfg, t = self.config, self.config.training
        self._join_job()
        # Megatron offsets the seed per pipeline stage; init does not use it (weights are seeded
        # per parameter name), dropout and other runtime randomness do.
        seed_everything(t.seed + 100 * self.topology.pp_rank)
        self.plugins.pm.hook.topology_ready(topology=self.topology)

        self.tokenizer = self.plugins.tokenizers.get(cfg.tokenizer_name).build(cfg.tokenizer)
        vocab = self.tokenizer.vocab_size
        divisor = cfg.data.make_vocab_size_divisible_by * self.topology.tensor_model_parallel_size
        self.padded_vocab = padded_vocab_size(vocab, divisor)
        self.display.print(
            f" > padded vocab (size: {vocab}) with {self.padded_vocab - vocab} dummy tokens"
            f" (new size: {self.padded_vocab})"
        )
        ctx = BuildContext(
            seed=t.seed,
            device=self.device.type,
            params_dtype=cfg.precision.params_dtype,
            seq_length=t.seq_length,
            padded_vocab_size=self.padded_vocab,
            tokenizer=self.tokenizer,
            topology=self.topology,
        )
        gbs = cfg.global_batch_size
        request = DataRequest(
            split=cfg.data.split,
            data_path=tuple(cfg.data.data_path),
            num_samples=requested_samples(t.train_iters, t.eval_interval, t.eval_iters, gbs),
            cache_path=cfg.data.data_cache_path,
        )
        dataset_spec = self.plugins.datasets.get(cfg.dataset_name)
        try:
            self.splits = dataset_spec.build(cfg.dataset, request, ctx)
        except (ValueError, FileNotFoundError) as exc:
            raise MegaUsageError(f"dataset '{cfg.dataset_name}': {exc}") from None

        model_spec = self.plugins.models.get(cfg.model_name)
        try:
            model = model_spec.build(cfg.model, ctx)  # fp32 on the CPU: the exact seeded init
        except ValueError as exc:
            raise MegaUsageError(f"model '{cfg.model_name}': {exc}") from None
        self.num_parameters = sum(p.numel() for p in model.parameters())  # global, before sharding
        plan = model_spec.parallel_plan(cfg.model) if model_spec.parallel_plan else None
        pipeline, _ = pipeline_setup(cfg, self.plugins)
        layout = pipeline.layout if pipeline else None
        model, chunks = parallelize(model, plan, cfg.parallel, self.topology, layout)
        dtype = DTYPES[cfg.precision.params_dtype]
        self.model = model.to(device=self.device, dtype=dtype)  # the chunks share its modules
        compile_layers = self._compile_by_default() if t.compile is None else t.compile
        if compile_layers:
            compile_model(self.model, plan)
        p = cfg.parallel
        self.buffer = ParamAndGradBuffer.build(
            self.model,
            self.topology,
            bucket_size=p.ddp_bucket_size,
            overlap=p.overlap_grad_reduce,
            distributed=p.use_distributed_optimizer,
            tied=tied_weights(self.model, plan, self.topology.pp_rank, layout.pp) if layout else [],
        )
        if t.gradient_accumulation_fusion:
            for param in self.buffer.params:  # honoured by mega.core.linear's linear layers
                param.fuse_wgrad = True
        self.optimizer = MixedPrecisionAdamW(self.buffer, cfg.optimizer, cfg.precision)
        self.pipeline = None
        if pipeline is None:
            self.schedule = self.plugins.parallel.get(cfg.parallel.parallel).build(cfg)
        else:
            self.pipeline = self._pipeline_executor(pipeline, chunks, plan, dtype)
            self.display.print(f" > pipeline layers by rank and chunk: {layout.describe()}")
        s = cfg.scheduler
        decay_iters = s.lr_decay_iters or t.train_iters
        self.lr_schedule = LRSchedule(
            max_lr=cfg.optimizer.lr,
            min_lr=cfg.optimizer.min_lr,
            decay_style=s.lr_decay_style,
            decay_iters=decay_iters,
            warmup_iters=resolve_warmup_iters(s.lr_warmup_iters, s.lr_warmup_fraction, decay_iters),
            warmup_init=s.lr_warmup_init,
            wsd_decay_style=s.lr_wsd_decay_style,
            wsd_decay_iters=s.lr_wsd_decay_iters,
        )
        self.flops_per_token = model_spec.flops_per_token(
            cfg.model, t.seq_length, self.padded_vocab
        )
        if cfg.checkpoint.load:
            self._load(cfg.checkpoint.load)
        self._open_run_files()
        self.display.panel(
            "mega",
            [
                f"model {cfg.model_name}: {self.num_parameters:,} parameters, {cfg.precision.params_dtype}",
                f"data {cfg.dataset_name}, tokenizer {cfg.tokenizer_name}, seq {t.seq_length}",
                f"global batch {gbs} = {cfg.num_microbatches} micro-batches x {t.micro_batch_size}",
                f"{self.topology.describe()} on {self.device}, schedule {cfg.parallel.parallel}",
                f"run directory {self.run_dir}",
            ],
        )

    def _compile_by_default(self) -> bool:
        """--compile's default: on a GPU without tensor parallelism, where it was measured to
        win (1.3B GPT on one H100: 55.7k against 50.8k tokens/s)."""
        return self.device.type == "cuda" and self.topology.tensor_model_parallel_size == 1

    def _pipeline_executor(
        self, pipeline: PipelineSetup, chunks: list, plan: Any, dtype: torch.dtype
    ) -> Any:
        from mega.plugins.parallel.pipeline.executor import PipelineExecutor

        t, p = self.config.training, self.config.parallel
        positions = t.seq_length // (p.tensor_model_parallel_size if p.sequence_parallel else 1)
        return PipelineExecutor(
            name=pipeline.spec.name,
            chunks=chunks,
            table=pipeline.spec.table,
            layout=pipeline.layout,
            topology=self.topology,
            activation_shape=plan.activation_shape(t.micro_batch_size, positions),
            dtype=dtype,
            device=self.device,
            forward_fn=model_forward,
            loss_fn=masked_mean,
            overlap_p2p=p.overlap_p2p_communication,
        )

    def _open_run_files(self) -> None:
        """Write the resolved config and plugin versions; open the metrics sinks."""
        cfg = self.config
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(
            cfg.logging.run_dir or cfg.checkpoint.save or f"runs/{cfg.model_name}-{stamp}"
        )
        if not self.topology.is_rank0:  # one writer of the run's files: rank 0
            return
        for directory in {self.run_dir, Path(cfg.checkpoint.save or self.run_dir)}:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_text(directory / "config.resolved.toml", to_toml(resolved_as_dict(cfg)))
            atomic_write_text(directory / "plugins.txt", plugins_txt(self.plugins))
        self._sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
        if cfg.logging.tensorboard_dir:
            self._sinks.append(TensorBoardSink(cfg.logging.tensorboard_dir))

    # ------------------------------------------------------------------ one step

    def run_step(self, microbatches: list[dict[str, torch.Tensor]], iteration: int) -> StepResult:
        """Forward/backward over the global batch through the schedule, then the optimizer."""
        # Megatron's scheduler advances only on successful steps, and a step uses the LR it held
        # before stepping; the line logs the LR after this step, as Megatron's does.
        successful = iteration - 1 - self.skipped_total
        lr = self.lr_schedule.lr_at(successful)
        self.buffer.start_step(len(microbatches))
        scale = self.optimizer.loss_scale
        if self.pipeline is not None:
            losses = self.pipeline.forward_backward(microbatches, grad_scale=scale)
        else:
            losses = self.schedule(self.model, microbatches, masked_lm_loss, grad_scale=scale)
        self.buffer.finish_grad_sync()
        outcome = self.optimizer.step(lr, iteration)
        return StepResult(
            loss=self._batch_loss(losses),
            skipped=outcome.skipped,
            grad_norm=outcome.grad_norm,
            learning_rate=self.lr_schedule.lr_at(successful + (0 if outcome.skipped else 1)),
            loss_scale=self.optimizer.loss_scale,
        )

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float]:
        """Train to ``--train-iters``; returns the metrics of the last iteration line."""
        cfg, t = self.config, self.config.training
        gbs, hook = cfg.global_batch_size, self.plugins.pm.hook
        last: dict[str, float] = {}
        error: BaseException | None = None
        try:
            self.setup()
            self.display.start_progress(t.train_iters, self.iteration, "training")
            while self.iteration < t.train_iters:
                iteration = self.iteration + 1
                self.model.train()
                batch = self._microbatches(self.splits.train, self.consumed_samples)
                result = hook.train_step(engine=self, microbatches=batch, iteration=iteration)
                self.iteration, self.consumed_samples = iteration, self.consumed_samples + gbs
                interval = self.interval
                interval.iterations += 1
                if result.skipped:
                    interval.skipped_losses.append(result.loss)
                    self.skipped_total += 1
                else:
                    interval.losses.append(result.loss)
                    interval.grad_norm = result.grad_norm
                metrics = {"iteration": iteration, "consumed_samples": self.consumed_samples}
                # iteration 1 too, so a run shows where its loss started
                if iteration % t.log_interval == 0 or iteration in (1, t.train_iters):
                    self._stop_if_nonfinite()  # the line syncs anyway
                    metrics.update(self._log(interval, result))
                    last, self.interval = metrics, IntervalStats()
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
            self._stop_if_nonfinite()
            if cfg.checkpoint.save and not self._saved_at(self.iteration):
                self.save()
            self.display.stop_progress()
            self._final_evaluation()
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.display.stop_progress()
            hook.shutdown(engine=self, exc=error)
            for sink in self._sinks:
                sink.close()
        return last

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

    def _microbatches(self, source: Any, first_sample: int) -> list[dict[str, torch.Tensor]]:
        """This data-parallel rank's share of the global batch starting at ``first_sample``."""
        t, topo = self.config.training, self.topology
        return global_batch(
            source,
            first_sample,
            self.config.global_batch_size,
            t.micro_batch_size,
            self.device,
            topo.dp_rank,
            topo.data_parallel_size,
        )

    def _batch_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of this rank's micro-batch losses; 0 on pipeline stages without the loss."""
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).mean()

    def _dp_mean(self, values: list[torch.Tensor]) -> list[float]:
        """Per-rank loss means -> their mean over the data-parallel ranks, synced to the host.
        Only the last pipeline stage has losses (the others hold zeros): summed over the stages."""
        if not values:
            return []
        stacked = torch.stack(values).float()
        comm.all_reduce(stacked, self.topology.group("pp"))
        group = self.topology.group("dp")
        if group is not None:
            comm.all_reduce(stacked, group)
            stacked /= self.topology.data_parallel_size
        return stacked.tolist()

    def _peak_memory_gb(self) -> float:
        """The largest peak of allocated GPU memory over all ranks so far, in GiB."""
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], device=self.device)
        if self.topology.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak) / 2**30

    def _log(self, interval: IntervalStats, result: StepResult) -> dict[str, float]:
        """Sync the interval's losses once, print the iteration line, feed the sinks."""
        cfg, t = self.config, self.config.training
        elapsed_ms = interval.elapsed_ms_per_iteration()
        losses = self._dp_mean(interval.losses)
        finite = [x for x in losses if math.isfinite(x)]
        # Megatron counts a NaN iteration when a *skipped* step's loss was inf or NaN
        skipped = self._dp_mean(interval.skipped_losses)
        nan_count = sum(not math.isfinite(x) for x in skipped)
        self.nan_total += nan_count
        tokens_per_s = cfg.global_batch_size * t.seq_length / (elapsed_ms / 1000.0)
        metrics: dict[str, float] = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "elapsed_ms": elapsed_ms,
            "learning_rate": result.learning_rate,
            "global_batch_size": cfg.global_batch_size,
            "loss_scale": result.loss_scale,
            "skipped_iterations": interval.skipped,
            "nan_iterations": nan_count,
            "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tokens_per_s * self.flops_per_token / 1e12 / self.topology.world_size,
        }
        if finite:
            metrics["lm_loss"] = sum(finite) / len(finite)
        if interval.grad_norm is not None:
            metrics["grad_norm"] = float(interval.grad_norm)
        if self.device.type == "cuda":
            metrics["max_memory_gb"] = self._peak_memory_gb()
        self.display.print(format_iteration_line(metrics, t.train_iters))
        record = {**metrics, "skipped_total": self.skipped_total, "nan_total": self.nan_total}
        for sink in self._sinks:
            sink.write(record)
        return metrics

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, source: Any, first_sample: int) -> float:
        """Mean lm loss over ``--eval-iters`` global batches starting at ``first_sample``."""
        t, gbs = self.config.training, self.config.global_batch_size
        self.model.eval()
        losses = []
        for k in range(t.eval_iters):
            microbatches = self._microbatches(source, first_sample + k * gbs)
            if self.pipeline is not None:
                losses += self.pipeline.forward_only(microbatches)
            else:
                losses += [masked_lm_loss(self.model, mb) for mb in microbatches]
        self.model.train()
        return self._dp_mean([self._batch_loss(losses)])[0]

    def _evaluate(self, source: Any, first_sample: int, label: str) -> float:
        started = time.perf_counter()
        loss = self.evaluate(source, first_sample)
        self.interval.excluded += time.perf_counter() - started  # not training time
        self.display.print(format_eval_line(label, loss))
        for sink in self._sinks:
            sink.write({"iteration": self.iteration, "valid_lm_loss": loss})
        return loss

    def _final_evaluation(self) -> None:
        t, gbs = self.config.training, self.config.global_batch_size
        if not t.eval_iters:
            return
        if self.splits.valid is not None:
            first = (t.train_iters // t.eval_interval) * t.eval_iters * gbs
            self._evaluate(self.splits.valid, first, "validation loss at the end of training")
        if self.splits.test is not None:
            self._evaluate(self.splits.test, 0, "test loss at the end of training")

    # ------------------------------------------------------------------ checkpoints

    def _saved_at(self, iteration: int) -> bool:
        return getattr(self, "_last_saved", None) == iteration

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": "mega-torch/1",
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "skipped_total": self.skipped_total,
            "nan_total": self.nan_total,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": capture_rng_state(),
            "lr_schedule": self.lr_schedule.state_dict(),
            "interval": self.interval.state_dict(),  # so a mid-interval resume logs the same
            "config": resolved_as_dict(self.config),
        }

    def save(self) -> Path:
        self._stop_if_nonfinite()
        cfg = self.config.checkpoint
        backend = self.plugins.checkpoint_backends.get(cfg.ckpt_format)
        started = time.perf_counter()
        path = save_checkpoint(cfg.save, self.iteration, self.state_dict(), backend)
        self.interval.excluded += time.perf_counter() - started  # not training time
        self._last_saved = self.iteration
        self.display.print(f" saved checkpoint at iteration {self.iteration:8d} to {path}")
        self.plugins.pm.hook.checkpoint_saved(path=str(path), iteration=self.iteration)
        return path

    def _load(self, path: str) -> None:
        if find_checkpoint(path) is None:  # --load == --save on a first run: start fresh
            self.display.print(f" no checkpoint in {path} yet: starting from scratch")
            return
        directory, state = load_checkpoint(path, self.plugins.checkpoint_backends)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise MegaUsageError(
                f"--load {directory}: does not match this model ({first})"
            ) from None
        s = self.config.scheduler
        if s.use_checkpoint_opt_param_scheduler:
            self.lr_schedule = LRSchedule.from_state_dict(state["lr_schedule"])
        else:
            check_schedule(self.lr_schedule, state["lr_schedule"], directory, s)
        for warning in data_changes(state["config"], resolved_as_dict(self.config)):
            self.display.warn(warning)
        restore_rng_state(state["rng"])
        self.interval = IntervalStats.from_state_dict(state["interval"])
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
        self.skipped_total = int(state["skipped_total"])
        self.nan_total = int(state["nan_total"])
        self._last_saved = self.iteration
        self.display.print(f" loaded checkpoint {directory} at iteration {self.iteration}")
