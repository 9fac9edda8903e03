"""The run's metrics sinks, a built-in plugin on the lifecycle hooks: ``metrics.jsonl`` in the run
directory always, TensorBoard with ``--tensorboard-dir``, Weights & Biases with
``--wandb-project``. Rank 0 writes; the sinks open at the run's first record.

``step_end`` writes the records the run logged since the last hook (an evaluation's: they wait
in ``engine.log.records``), then, on a logging iteration, the line's record: the hook's
``metrics`` with the run's ``skipped_total`` and ``nan_total``. It runs first (``tryfirst``;
the plan check's wrapper adds ``planned_memory_gb`` before it), so a plugin whose ``step_end``
fails or hangs after it takes no record away. ``checkpoint_saved`` writes the waiting records,
so a complete checkpoint has every record before it on disk; ``shutdown`` writes the rest and
closes the sinks. Block the plugin (``MEGA_BLOCK_PLUGINS=metrics_sinks``) to put sinks of your
own in their place. Cheap to import."""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Any

from mega import hookimpl

# engine -> its open sinks (rank 0, from the first record to shutdown)
_sinks: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def open_sinks(config: Any, run_dir: Path, start_iteration: int) -> list[Any]:
    """The sinks of a run whose training starts at ``start_iteration`` (a loaded checkpoint's).
    Appending to a run's ``metrics.jsonl`` first writes a resume marker, so readers drop the
    records after ``start_iteration`` that this run will log again (``metrics_history``)."""
    from mega.core.console.metrics import JsonlSink, TensorBoardSink
    from mega.core.console.metrics_history import METRICS_FILE, resume_record

    metrics_file = run_dir / METRICS_FILE
    restarted = metrics_file.is_file() and metrics_file.stat().st_size > 0
    sinks: list[Any] = [JsonlSink(metrics_file)]
    if restarted:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        load = config.checkpoint.load
        sinks[0].write(resume_record(start_iteration, time=stamp, load=load))
    log = config.logging
    if log.tensorboard_dir:
        sinks.append(TensorBoardSink(log.tensorboard_dir))
    if log.wandb_project:
        from mega.core.config.resolve import resolved_as_dict
        from mega.core.console.wandb_sink import WandbSink

        save_dir = log.wandb_save_dir or run_dir / "wandb"
        run_config = resolved_as_dict(config)
        sinks.append(WandbSink(log.wandb_project, log.wandb_exp_name, save_dir, run_config))
    return sinks


def _write(engine: Any, records: list[dict[str, Any]], *, open_anyway: bool = False) -> None:
    """Write ``records`` to the engine's sinks, opening them first if need be. Nothing on ranks
    other than 0, nor before the run's log is open (a setup that failed before)."""
    log = getattr(engine, "log", None)
    if log is None or log.records is None:
        return
    records = log.take_records() + records
    if engine not in _sinks:
        if not (records or open_anyway):
            return
        _sinks[engine] = open_sinks(engine.config, log.run_dir, log.start_iteration)
    for record in records:
        for sink in _sinks[engine]:
            sink.write(record)


@hookimpl(tryfirst=True)
def step_end(engine: Any, iteration: int, metrics: dict[str, Any]) -> None:
    line = []
    if "elapsed_ms" in metrics:  # a logging iteration: its line's record
        totals = {"skipped_total": engine.skipped_total, "nan_total": engine.nan_total}
        line.append({**metrics, **totals})
    _write(engine, line)


@hookimpl(tryfirst=True)
def checkpoint_saved(engine: Any) -> None:
    _write(engine, [])


@hookimpl(trylast=True)
def shutdown(engine: Any, exc: BaseException | None) -> None:
    try:
        _write(engine, [], open_anyway=True)  # a run's metrics.jsonl exists once it has set up
    finally:
        for sink in _sinks.pop(engine, []):
            sink.close()
