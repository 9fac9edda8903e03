"""The plan check, a built-in plugin on the lifecycle hooks: every GPU run checks the planner.

At ``topology_ready`` rank 0 starts the planner beside the run (``mega.core.plan.check``: a child
process planning the run's config as ``mega plan`` would). The first iteration line after it has
reported sets the planned peak memory against the measured one: a console line, and
``planned_memory_gb`` in that line's ``metrics`` (its ``step_end`` is a wrapper, so every other
implementation, the sinks' included, sees it). A run shorter than the planner waits for it (up
to a minute) at its last iteration, or, stopped early by an exit condition, at ``shutdown``, in
a record of its own; ``shutdown`` also ends a planner still counting. Turn it off with
``MEGA_BLOCK_PLUGINS=plan_check``. Cheap to import."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from mega import hookimpl

WAIT_AT_END_S = 60.0  # how long a run that ends first waits for the planner


@dataclass
class _Check:
    planner: Any  # a mega.core.plan.check.PlanCheck
    peak_gib: float | None = None  # the largest rank's peak at the last iteration line


_checks: weakref.WeakKeyDictionary[Any, _Check] = weakref.WeakKeyDictionary()


@hookimpl
def topology_ready(topology: Any, engine: Any) -> None:
    if not topology.is_rank0:
        return
    from mega.core.plan.check import start_plan_check

    planner = start_plan_check(engine.config, engine.device)  # None on the CPU
    if planner is not None:
        _checks[engine] = _Check(planner)


def _report(engine: Any, check: _Check, record: dict[str, Any], wait_s: float) -> None:
    """Once the planner has reported: its peak against the measured one, in a line and in
    ``record`` (``planned_memory_gb``)."""
    planned = check.planner.result(wait_s)
    if planned is None:
        return
    _checks.pop(engine, None)
    engine.display.print(planned.memory_line(check.peak_gib))
    if not planned.error:
        record["planned_memory_gb"] = round(planned.peak_gib, 3)


@hookimpl(wrapper=True)
def step_end(engine: Any, iteration: int, metrics: dict[str, Any]) -> Any:
    check = _checks.get(engine)
    if check is not None and "max_memory_gb" in metrics:  # GPU runs' logging iterations
        check.peak_gib = metrics["max_memory_gb"]
        last = iteration >= engine.config.train_iters
        _report(engine, check, metrics, WAIT_AT_END_S if last else 0.0)
        if last and _checks.pop(engine, None) is not None:  # it did not report in time
            check.planner.stop()
    return (yield)


@hookimpl(tryfirst=True)
def shutdown(engine: Any, exc: BaseException | None) -> None:
    check = _checks.pop(engine, None)
    if check is None:
        return
    try:
        if exc is None and check.peak_gib is not None:  # stopped early: the record of its own
            record: dict[str, Any] = {}
            _report(engine, check, record, WAIT_AT_END_S)
            if record:  # with the peak it was set against
                peak = {"iteration": engine.iteration, "max_memory_gb": check.peak_gib}
                engine.log.write({**peak, **record})
    finally:
        check.planner.stop()
