"""What a checkpoint holds of a training run, and putting it back: model, optimizer, RNG,
learning-rate schedule, data position and the logging interval, so that the loss curve after a
resume is the one without the interruption."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mega.core.checkpoint.host_copy import HostCopy, bytes_needed
from mega.core.checkpoint.resume_checks import (
    check_schedule,
    data_changes,
    data_order,
    nothing_to_train,
)
from mega.core.checkpoint.sharded_store import (
    load_sharded,
    prepare_pinned_copies,
    read_metadata,
    start_sharded_save,
)
from mega.core.checkpoint.store import (
    find_checkpoint,
    iteration_dir,
    load_checkpoint,
    read_marker,
    save_checkpoint,
    write_tracker,
)
from mega.core.checkpoint.strict import model_flag_changes, state_dict_mismatch
from mega.core.config.resolve import resolved_as_dict
from mega.core.console.metrics import IntervalStats
from mega.core.schedules.learning_rate import LRSchedule
from mega.core.training.rng import capture_rng_state, restore_rng_state
from mega.errors import MegaUsageError, first_line

FORMAT = "mega-torch/1"


def common_state(engine: Any) -> dict[str, Any]:
    """What every rank of a run shares, without the model and optimizer tensors: counters,
    schedules, the config, the layout it was written with."""
    return {
        "format": FORMAT,
        "iteration": engine.iteration,
        "consumed_samples": engine.consumed_samples,
        "skipped_total": engine.skipped_total,
        "scheduler_steps": engine.scheduler_steps,  # the LR schedule's count (mega.core.schedules.samples)
        "nan_total": engine.nan_total,
        "lr_schedule": engine.lr_schedule.state_dict(),
        "interval": engine.interval.state_dict(),  # so a mid-interval resume logs the same
        "config": resolved_as_dict(engine.config),
        "data_order": data_order(engine.config),  # as used: no unset (None) values
        "cpu_threads": cpu_threads(engine.device),
        "layout": layout_of(engine),
        "optimizer_scalars": engine.optimizer.scalar_state(),
    }


def training_state(engine: Any) -> dict[str, Any]:
    """The ``Engine``'s whole state as a whole-state (one-process) backend stores it."""
    return {
        **common_state(engine),
        "model": model_without_padding(engine.model.state_dict(), engine.vocab_rows),
        "vocab_unpadded": True,  # older torch checkpoints kept the padding rows
        "optimizer": engine.optimizer.state_dict(),
        **rank_rng_state(engine),
        **fp8_scaling_state(engine),
    }


def rank_rng_state(engine: Any) -> dict[str, Any]:
    """This rank's random streams: the default generators (``rng``) and, under tensor
    parallelism, the TP RNG tracker's model-parallel stream (``tensor_parallel_rng``: attention
    dropout on this rank's heads, and every dropout on this rank's tokens under sequence
    parallelism), which differs on every TP rank."""
    state = {"rng": capture_rng_state()}
    tracker = getattr(engine.model, "tensor_parallel_rng", None)
    if tracker is not None:
        state["tensor_parallel_rng"] = tracker.get_state()
    return state


def restore_rank_rng(engine: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`rank_rng_state` captured (a checkpoint from before the tracker was
    saved leaves it as seeded: dropout on sharded activations then differs from the
    uninterrupted run)."""
    if state.get("rng") is not None:
        restore_rng_state(state["rng"])
    tracker = getattr(engine.model, "tensor_parallel_rng", None)
    if tracker is not None and state.get("tensor_parallel_rng") is not None:
        tracker.set_state(state["tensor_parallel_rng"])


def fp8_scaling_state(engine: Any) -> dict[str, Any]:
    """--fp8-recipe delayed: the amax histories and scales (``mega.parallel.fp8.delayed``)."""
    scaling = getattr(engine, "fp8_scaling", None)
    if scaling is None:
        return {}
    return {"fp8_scaling": {k: v.detach().clone() for k, v in scaling.state().items()}}


def restore_fp8_scaling(engine: Any, state: dict[str, Any], tensors_loaded: bool) -> None:
    """Put a checkpoint's delayed-scaling state back (a sharded load has already read it into
    the buffers); a checkpoint without it leaves the first step to seed the histories."""
    scaling = getattr(engine, "fp8_scaling", None)
    if scaling is None:
        return
    if not tensors_loaded:
        saved = state.get("fp8_scaling", {})
        for key, buffer in scaling.state().items():
            if key in saved:
                buffer.copy_(saved[key])
    scaling.loaded()


def model_without_padding(model: dict[str, Any], vocab_rows: dict[str, int]) -> dict[str, Any]:
    """The model's tensors with vocabulary-sized ones cut to the real vocabulary, as sharded
    checkpoints store them: their padding (which depends on TP and
    --make-vocab-size-divisible-by) learns nothing, and a converter reads the real vocabulary."""
    return {name: t[: vocab_rows[name]] if name in vocab_rows else t for name, t in model.items()}


def model_with_padding(
    model: Any, vocab_rows: dict[str, int], saved: dict[str, Any]
) -> dict[str, Any]:
    """``saved`` model tensors, vocabulary-sized ones (``vocab_rows``) grown back to ``model``'s
    padded rows (the padding keeps the model's values: it is masked out and never trained)."""
    current = model.state_dict()
    out = dict(saved)
    for name, rows in vocab_rows.items():
        t = saved.get(name)
        if t is not None and name in current and t.shape[0] == rows < current[name].shape[0]:
            full = current[name].detach().clone()
            full[:rows] = t
            out[name] = full
    return out


def layout_of(engine: Any) -> dict[str, Any]:
    """The parallel layout a checkpoint is written with (RNG states are per rank of it)."""
    topo, p = engine.topology, engine.config.parallel
    return {
        "world_size": topo.world_size,
        "tensor_model_parallel_size": topo.tensor_model_parallel_size,
        "pipeline_model_parallel_size": topo.pipeline_model_parallel_size,
        "data_parallel_size": topo.data_parallel_size,
        "context_parallel_size": topo.context_parallel_size,
        "expert_model_parallel_size": topo.expert_model_parallel_size,
        "virtual_pipeline_model_parallel_size": engine.executor.layout.vpp,
        "sequence_parallel": bool(p.sequence_parallel),
        "use_distributed_optimizer": bool(p.use_distributed_optimizer),
    }


def sharded_tensors(engine: Any, *, for_load: bool = False, with_optimizer: bool = True) -> list:
    """The engine's model and optimizer as this rank's ``ShardedTensor``s."""
    from mega.parallel.sharded_state import fp8_scaling_tensors, training_tensors

    tensors = training_tensors(
        engine.model,
        engine.optimizer,
        engine.topology,
        engine.vocab_rows,
        with_optimizer=with_optimizer,
        for_load=for_load,
    )
    scaling = getattr(engine, "fp8_scaling", None)
    return tensors + (fp8_scaling_tensors(scaling, engine.topology) if scaling else [])


def cpu_threads(device: Any) -> int | None:
    """torch's intra-op thread count on the CPU (None on a GPU). The one input outside the flags
    that changes a CPU run's bits: a float sum splits differently over a different number of
    threads."""
    import torch

    return torch.get_num_threads() if device.type == "cpu" else None


def _thread_warning(saved: int | None, now: int | None) -> str | None:
    if saved is None or now is None or saved == now:
        return None
    plural = lambda n: f"{n} CPU thread{'s' if n != 1 else ''}"  # noqa: E731
    return (
        f"this run uses {plural(now)} and the checkpoint was trained with {saved}: float sums"
        " split differently over threads, so the losses will differ in the last digits"
        " (set OMP_NUM_THREADS to match)"
    )


def restore_training_state(
    engine: Any, directory: Path, state: dict[str, Any], tensors_loaded: bool = False
) -> None:
    """Put ``state`` (read from ``directory``) back into ``engine``; a checkpoint of another
    model is a ``MegaUsageError``, a changed data or schedule setting a warning or an error.

    As Megatron's ``load_checkpoint``: ``--finetune`` loads the weights only (iteration 0, no
    consumed samples, fresh optimizer and RNG); ``--no-load-optim`` keeps the fresh optimizer
    (and, with it, the command line's schedule), ``--no-load-rng`` the freshly seeded RNG."""
    ckpt = engine.config.checkpoint
    load_optim = ckpt.load_optim and not ckpt.finetune
    try:
        if not tensors_loaded:
            _check_model_keys(engine, directory, state)
            engine.model.load_state_dict(
                model_with_padding(engine.model, engine.vocab_rows, state["model"])
            )
            if load_optim:
                engine.optimizer.load_state_dict(state["optimizer"])
        elif load_optim:
            engine.optimizer.load_scalar_state(state["optimizer_scalars"])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise MegaUsageError(
            f"--load {directory}: does not match this model ({first_line(exc)})"
        ) from None
    restore_fp8_scaling(engine, state, tensors_loaded)
    if not load_optim:  # a fresh optimizer: its fp32 masters from the loaded weights
        engine.optimizer.masters_from_params()
    if ckpt.finetune:
        return  # a new run from these weights: the counters stay at 0
    s = engine.config.scheduler
    if not load_optim:
        pass  # Megatron loads the scheduler with the optimizer: the command line's applies
    elif s.use_checkpoint_opt_param_scheduler:
        engine.lr_schedule = LRSchedule.from_state_dict(state["lr_schedule"])
    else:
        check_schedule(engine.lr_schedule, state["lr_schedule"], directory, s)
    saved_order = state.get("data_order") or state["config"]
    for warning in data_changes(saved_order, data_order(engine.config)):
        engine.display.warn(warning)
    threads = _thread_warning(state.get("cpu_threads"), cpu_threads(engine.device))
    if threads:
        engine.display.warn(threads)
    if ckpt.load_rng:
        restore_rank_rng(engine, state)
    engine.interval = IntervalStats.from_state_dict(state["interval"])
    engine.iteration = int(state["iteration"])
    engine.consumed_samples = int(state["consumed_samples"])
    engine.skipped_total = int(state["skipped_total"])
    engine.nan_total = int(state["nan_total"])
    # checkpoints from before the count was saved were iteration-based: successful iterations
    engine.scheduler_steps = int(
        state.get("scheduler_steps", engine.iteration - engine.skipped_total)
    )


def model_flags_hint(engine: Any, saved_config: Any) -> str:
    """What to add to a mismatch error: the model flags that differ from the checkpoint's."""
    return model_flag_changes(saved_config, resolved_as_dict(engine.config))


def _check_model_keys(engine: Any, directory: Path, state: dict[str, Any]) -> None:
    """Strict loading of a whole-state checkpoint: its model tensors are the model's, by name."""
    saved = state.get("model")
    if not isinstance(saved, dict):
        return  # load_state_dict reports it
    problem = state_dict_mismatch(engine.model, saved)
    if problem:
        hint = model_flags_hint(engine, state.get("config"))
        raise MegaUsageError(f"--load {directory}: does not match this model: {problem}{hint}")


def _rank_rng(engine: Any, state: dict[str, Any], ranks: list[dict[str, Any]]) -> dict:
    """This rank's random states from a sharded checkpoint (:func:`rank_rng_state`'s keys): only
    at the layout that wrote it. At another, a rank has no counterpart whose streams it could
    continue (the TP tracker's stream is per TP rank, seeded ``seed + 2718 + tp_rank``), so every
    rank keeps its freshly seeded generators; it matters only with dropout."""
    if state.get("layout") == layout_of(engine):
        mine = ranks[engine.topology.rank]
        return {key: mine.get(key) for key in ("rng", "tensor_parallel_rng")}
    if engine.config.checkpoint.load_rng and not engine.config.checkpoint.finetune:
        engine.display.print(
            " note: the checkpoint was written at another parallel layout; random states are"
            " seeded afresh (dropout masks differ from an uninterrupted run)"
        )
    return {"rng": None, "tensor_parallel_rng": None}


def save_run(engine: Any) -> Path:
    """Write the engine's state as a complete checkpoint under ``--save`` through the
    ``--ckpt-format`` backend; the time it takes is not training time."""
    cfg = engine.config.checkpoint
    backend = engine.plugins.checkpoint_backends.get(cfg.ckpt_format)
    started = time.perf_counter()
    finish_pending_save(engine)
    if backend.sharded:
        iteration = engine.iteration
        pending = start_sharded_save(
            iteration_dir(cfg.save, iteration),
            iteration,
            sharded_tensors(engine),
            common_state(engine),
            rank_rng_state(engine),
            backend,
            host_copy=_host_copy(engine) if cfg.async_save else None,
            after=lambda: write_tracker(cfg.save, iteration),
        )
        if cfg.async_save:  # finished at the next save or the end of training
            engine.pending_save = pending
            engine.last_saved = engine.iteration
            engine.interval.excluded += time.perf_counter() - started
            return iteration_dir(cfg.save, engine.iteration)
        path = pending.finish()
    else:
        path = save_checkpoint(cfg.save, engine.iteration, training_state(engine), backend)
    seconds = time.perf_counter() - started
    engine.interval.excluded += seconds
    engine.last_saved = engine.iteration
    # the "saved checkpoint" line is a built-in implementation (mega.plugins.lifecycle)
    engine.plugins.pm.hook.checkpoint_saved(
        path=str(path), iteration=engine.iteration, engine=engine, seconds=seconds
    )
    return path


def _host_copy(engine: Any) -> HostCopy:
    if getattr(engine, "host_copy", None) is None:
        engine.host_copy = HostCopy()
    return engine.host_copy


def prepare_async_save(engine: Any) -> None:
    """``--async-save`` on a GPU: allocate and pin the host buffer, and the host copies of the
    chunks this rank gathers (``shared_chunks``), before the first step (for GBs of state that
    takes seconds), so that the step starting the first save does not wait for it."""
    cfg = engine.config.checkpoint
    backend = engine.plugins.checkpoint_backends.get(cfg.ckpt_format)
    if not (cfg.save and cfg.async_save and backend.sharded and engine.device.type == "cuda"):
        return
    written = [t for t in sharded_tensors(engine) if t.write]
    _host_copy(engine).reserve(bytes_needed(written), engine.device)
    prepare_pinned_copies(written)


def finish_pending_save(engine: Any) -> Path | None:
    """Complete an ``--async-save`` checkpoint still being written (every rank calls it)."""
    pending = getattr(engine, "pending_save", None)
    if pending is None:
        return None
    engine.pending_save = None
    path = pending.finish()
    engine.plugins.pm.hook.checkpoint_saved(
        path=str(path), iteration=pending.iteration, engine=engine, seconds=None
    )
    return path


def _weights_only(directory: Path) -> MegaUsageError:
    return MegaUsageError(
        f"--load {directory}: holds weights only (written by mega convert-checkpoint);"
        " add --finetune to start a run from them"
    )


def load_run(engine: Any, path: str) -> None:
    """``--load``: the newest complete checkpoint under ``path`` into the engine, or a fresh
    start when there is none yet (``--save D --load D`` on a first run)."""
    started = time.perf_counter()
    partials = sorted(Path(path).glob(".iter_*.tmp")) if engine.topology.is_rank0 else []
    for partial in partials:  # a save that never finished: said once, by rank 0
        engine.display.warn(
            f"ignoring {partial}: an unfinished checkpoint (the save was interrupted)"
        )
    if find_checkpoint(path) is None:
        engine.display.print(f" no checkpoint in {path} yet: starting from scratch")
        return
    directory, marker, backend = read_marker(path, engine.plugins.checkpoint_backends)
    if marker.get("sharded"):
        ckpt = engine.config.checkpoint
        with_optimizer = ckpt.load_optim and not ckpt.finetune
        metadata = read_metadata(directory, marker)
        if metadata["common"].get("weights_only") and not ckpt.finetune:
            raise _weights_only(directory)
        saved_kind = metadata["common"].get("optimizer_scalars", {}).get("optimizer")
        problem = engine.optimizer.kind_mismatch(saved_kind) if with_optimizer else None
        if problem:  # named before any tensor is read (their keys differ by kind)
            raise MegaUsageError(f"--load {directory}: {problem}")
        tensors = sharded_tensors(engine, for_load=True, with_optimizer=with_optimizer)
        hint = model_flags_hint(engine, metadata["common"].get("config"))
        load_sharded(directory, marker, tensors, backend, metadata, hint)
        state = dict(metadata["common"])
        state.update(_rank_rng(engine, state, metadata["ranks"]))
        restore_training_state(engine, directory, state, tensors_loaded=True)
    else:
        if engine.topology.world_size > 1:
            raise MegaUsageError(
                f"--load {directory}: a --ckpt-format {marker.get('backend')} checkpoint holds"
                " one process's state; load it in one process and save it with --ckpt-format"
                " zarr to continue at another layout"
            )
        directory, state = load_checkpoint(path, engine.plugins.checkpoint_backends)
        ckpt = engine.config.checkpoint
        if state.get("weights_only") and not ckpt.finetune:
            raise _weights_only(directory)
        restore_training_state(engine, directory, state)
    engine.last_saved = engine.iteration
    seconds = time.perf_counter() - started
    engine.display.print(
        f" loaded checkpoint {directory} at iteration {engine.iteration} in {seconds:.1f} s"
    )
    late = nothing_to_train(engine.iteration, engine.config.train_iters)
    if late:
        engine.display.warn(late)
