"""Run a schedule table on paper: prove it finishes and respects its dependencies; time it.

Model of execution (see ``actions.py`` for what each action means):

- every rank runs its list in order, one action at a time, starting at time 0;
- ``Forward`` takes ``forward_cost`` and ``Backward`` ``backward_cost`` time units; costs are *per
  action*, i.e. per model chunk. With ``vpp`` chunks a chunk is 1/vpp of a rank's layers, so "unit
  costs" here mean a whole stage costs ``vpp`` units. The bubble fraction does not depend on that
  scale, which is why the analytic ``(p-1)/(v m + p-1)`` holds exactly with the default 1 and 1;
- point-to-point transfers take no time. A send never blocks (it is posted at the rank's current
  time). A receive blocks until its matching send has been posted, and completes at
  ``max(now, time of the send)``;
- the run deadlocks when no rank can take its next action while some still have actions left.

``check_table`` finds structural mistakes without running anything; ``simulate`` runs those checks,
executes the table, checks the timeline's data dependencies again, and raises ``ScheduleError``
listing every problem it found.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mega.plugins.parallel.pipeline.actions import (
    Action,
    Backward,
    Compute,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    Table,
    stage_place,
    virtual_stage,
)

MAX_PROBLEMS = 20  # problems listed in a ScheduleError before "... and N more"


class ScheduleError(Exception):
    """A table that cannot run as written: the problems, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_PROBLEMS]
        more = len(self.problems) - len(shown)
        super().__init__("; ".join(shown) + (f"; ... and {more} more" if more > 0 else ""))


@dataclass(frozen=True)
class Slot:
    """One compute action of a rank's timeline: it ran from ``start`` to ``end``."""

    start: float
    end: float
    action: Compute


@dataclass(frozen=True)
class SimulationResult:
    """Per-rank timelines (compute actions only, in order), makespan and bubble fraction."""

    pp: int
    vpp: int
    microbatches: int
    forward_cost: float
    backward_cost: float
    timelines: dict[int, list[Slot]]
    total_time: float
    bubble_fraction: float  # idle compute time / (pp * total_time)


def _key(kind: str, microbatch: int, src_stage: int, dst_stage: int) -> tuple[str, int, int, int]:
    return (kind, microbatch, src_stage, dst_stage)


def _p2p_key(rank: int, action: Action, pp: int) -> tuple[str, int, int, int] | None:
    """The transfer a send or receive takes part in, as (kind, micro-batch, from stage, to stage);
    a send and a receive match when their keys are equal."""
    stage = virtual_stage(rank, action.chunk, pp)
    mb = action.microbatch
    if isinstance(action, SendActivation):
        return _key("activation", mb, stage, stage + 1)
    if isinstance(action, RecvActivation):
        return _key("activation", mb, stage - 1, stage)
    if isinstance(action, SendGrad):
        return _key("grad", mb, stage, stage - 1)
    if isinstance(action, RecvGrad):
        return _key("grad", mb, stage + 1, stage)
    return None


def _describe(rank: int, action: Action) -> str:
    return f"rank {rank}: {action}"


def _check_action(rank: int, action: Action, pp: int, vpp: int, m: int) -> str | None:
    """Why one action is malformed (out-of-range ids, wrong peer, transfer past an end stage)."""
    if not isinstance(
        action, Forward | Backward | SendActivation | RecvActivation | SendGrad | RecvGrad
    ):
        return f"rank {rank}: {action!r} is not a pipeline action"
    if not 0 <= action.microbatch < m:
        return f"{_describe(rank, action)}: micro-batch outside 0..{m - 1}"
    if not 0 <= action.chunk < vpp:
        return f"{_describe(rank, action)}: chunk outside 0..{vpp - 1}"
    key = _p2p_key(rank, action, pp)
    if key is None:
        return None
    _, _, src, dst = key
    other = dst if isinstance(action, SendActivation | SendGrad) else src
    if not 0 <= other < pp * vpp:
        where = "before the first" if other < 0 else "after the last"
        return f"{_describe(rank, action)}: there is no virtual stage {where} one"
    if action.peer != stage_place(other, pp)[0]:
        return (
            f"{_describe(rank, action)}: virtual stage {other} is on rank"
            f" {stage_place(other, pp)[0]}, not {action.peer}"
        )
    return None


def check_table(table: Table, pp: int, vpp: int, m: int) -> list[str]:
    """Structural problems of a table, one line each (empty when it is well formed): every
    ``(micro-batch, chunk)`` forwarded and backwarded exactly once on each rank, forward before
    backward, each needed receive before its compute and each send after it, every send matched
    by exactly one receive."""
    if sorted(table) != list(range(pp)):
        return [f"the table's ranks are {sorted(table)}, expected 0..{pp - 1}"]
    problems: list[str] = []
    sends: Counter = Counter()
    recvs: Counter = Counter()
    last = pp * vpp - 1
    for rank in range(pp):
        position: dict[tuple[type, int, int], list[int]] = {}
        for index, action in enumerate(table[rank]):
            problem = _check_action(rank, action, pp, vpp, m)
            if problem:
                problems.append(problem)
                continue
            position.setdefault((type(action), action.microbatch, action.chunk), []).append(index)
            key = _p2p_key(rank, action, pp)
            if isinstance(action, SendActivation | SendGrad):
                sends[key] += 1
            elif key is not None:
                recvs[key] += 1

        def where(kind: type, mb: int, chunk: int, _position=position) -> list[int]:
            return _position.get((kind, mb, chunk), [])

        for mb in range(m):
            for chunk in range(vpp):
                stage = virtual_stage(rank, chunk, pp)
                fwd, bwd = where(Forward, mb, chunk), where(Backward, mb, chunk)
                name = f"rank {rank}: micro-batch {mb} chunk {chunk}"
                if len(fwd) != 1 or len(bwd) != 1:
                    problems.append(
                        f"{name}: {len(fwd)} forwards and {len(bwd)} backwards, expected one each"
                    )
                    continue
                if bwd[0] < fwd[0]:
                    problems.append(f"{name}: backward comes before its forward")
                # (transfer, the compute it serves, whether it must come before, is it needed);
                # a transfer past an end stage (not needed) was reported by _check_action
                transfers = [
                    (RecvActivation, fwd[0], True, stage > 0),
                    (SendActivation, fwd[0], False, stage < last),
                    (RecvGrad, bwd[0], True, stage < last),
                    (SendGrad, bwd[0], False, stage > 0),
                ]
                for kind, anchor, before, needed in transfers:
                    found = where(kind, mb, chunk)
                    when = "before its " if before else "after its "
                    when += "forward" if anchor == fwd[0] else "backward"
                    if not needed:
                        continue
                    if len(found) != 1:
                        problems.append(
                            f"{name}: {len(found)} {kind.__name__}, expected one {when}"
                        )
                    elif (found[0] < anchor) != before:
                        problems.append(f"{name}: {kind.__name__} is not {when}")
    for key in sorted(set(sends) | set(recvs)):
        kind, mb, src, dst = key
        if sends[key] != recvs[key]:
            problems.append(
                f"{kind} of micro-batch {mb} from virtual stage {src} to {dst}:"
                f" {sends[key]} sends but {recvs[key]} receives"
            )
    return problems


def _run(
    table: Table, pp: int, forward_cost: float, backward_cost: float
) -> tuple[dict[int, list[Slot]], list[str]]:
    """Execute the table; per-rank timelines and the deadlock report (empty when it finished)."""
    clock = dict.fromkeys(range(pp), 0.0)
    cursor = dict.fromkeys(range(pp), 0)
    posted: dict[tuple, float] = {}
    timelines: dict[int, list[Slot]] = {rank: [] for rank in range(pp)}
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            actions = table[rank]
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                if isinstance(action, Forward | Backward):
                    cost = forward_cost if isinstance(action, Forward) else backward_cost
                    start = clock[rank]
                    clock[rank] = start + cost
                    timelines[rank].append(Slot(start, clock[rank], action))
                elif isinstance(action, SendActivation | SendGrad):
                    posted[_p2p_key(rank, action, pp)] = clock[rank]
                else:
                    key = _p2p_key(rank, action, pp)
                    if key not in posted:
                        break  # blocked: the matching send has not been posted yet
                    clock[rank] = max(clock[rank], posted.pop(key))
                cursor[rank] += 1
                progress = True
    stuck = [rank for rank in range(pp) if cursor[rank] < len(table[rank])]
    if not stuck:
        return timelines, []
    waits = ", ".join(f"rank {r} waits at {table[r][cursor[r]]}" for r in stuck)
    return timelines, [f"deadlock: no rank can go on ({waits})"]


def _check_timeline(timelines: dict[int, list[Slot]], pp: int, vpp: int) -> list[str]:
    """Data dependencies, from the times: forward of stage s+1 after forward of stage s, backward
    of stage s after backward of stage s+1, and the last stage's backward after its forward."""
    end: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    for rank, slots in timelines.items():
        for slot in slots:
            kind = "F" if isinstance(slot.action, Forward) else "B"
            key = (kind, slot.action.microbatch, virtual_stage(rank, slot.action.chunk, pp))
            start[key], end[key] = slot.start, slot.end
    problems = []
    last = pp * vpp - 1
    for (kind, mb, stage), begin in start.items():
        before = ("F", mb, stage - 1) if kind == "F" else ("B", mb, stage + 1)
        if kind == "B" and stage == last:
            before = ("F", mb, stage)
        if before in end and begin < end[before]:
            problems.append(
                f"{kind}{mb} of virtual stage {stage} starts at {begin:g}, before"
                f" {before[0]}{mb} of virtual stage {before[2]} ends ({end[before]:g})"
            )
    return problems


def simulate(
    table: Table,
    pp: int,
    vpp: int,
    m: int,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
) -> SimulationResult:
    """Check and execute ``table``; raise ``ScheduleError`` if it is malformed, deadlocks or
    breaks a data dependency. ``bubble_fraction`` = idle compute time / (pp * total time)."""
    if forward_cost <= 0 or backward_cost <= 0:
        raise ValueError("forward and backward costs must be > 0")
    problems = check_table(table, pp, vpp, m)
    if problems:
        raise ScheduleError(problems)
    timelines, problems = _run(table, pp, forward_cost, backward_cost)
    if problems:
        raise ScheduleError(problems)
    problems = _check_timeline(timelines, pp, vpp)
    if problems:
        raise ScheduleError(problems)
    total = max((slots[-1].end for slots in timelines.values() if slots), default=0.0)
    busy = sum(slot.end - slot.start for slots in timelines.values() for slot in slots)
    # idle / capacity in one correctly rounded division: with integer costs both are exact, so the
    # result equals any other exact form of the same fraction, e.g. (p-1)/(m+p-1), bit for bit.
    bubble = (pp * total - busy) / (pp * total) if total > 0 else 0.0
    return SimulationResult(
        pp=pp,
        vpp=vpp,
        microbatches=m,
        forward_cost=forward_cost,
        backward_cost=backward_cost,
        timelines=timelines,
        total_time=total,
        bubble_fraction=bubble,
    )
