"""Run a schedule table on paper: prove it finishes and respects its dependencies; time it.

Model of execution (see ``actions.py`` for what each action means):

- every rank runs its list in order, one action at a time, starting at time 0;
- ``Forward`` takes ``forward_cost`` and ``Backward`` ``backward_cost`` time units; costs are *per
  action*, i.e. per model chunk. With ``vpp`` chunks a chunk is 1/vpp of a rank's layers, so "unit
  costs" here mean a whole stage costs ``vpp`` units. The bubble fraction does not depend on that
  scale, which is why the analytic ``(p-1)/(v m + p-1)`` holds exactly with the default 1 and 1.
  A backward whose ``WeightGrad`` is split off costs ``(1 - weight_grad_share) * backward_cost``
  and the ``WeightGrad`` the rest; ``WeightGrad`` actions right after a batch of transfers start
  when the batch is issued (they need nothing from it), and the next compute waits for both;
- point-to-point transfers take no time. How they wait depends on ``p2p``:

  - ``"eager"`` (default): a send never blocks (it is posted at the rank's current time). A
    receive blocks until its matching send has been posted, and completes at
    ``max(now, time of the send)``. Sends and receives match by what they carry.
  - ``"rendezvous"``: what the executor does with NCCL. A rank runs ``actions.p2p_batches`` of its
    list: each maximal run of consecutive sends and receives is one batch (one
    ``batch_isend_irecv``), issued when the rank reaches it; the rank's p2p ops are serialized, so
    the batch is *active* until it ends. The k-th send from rank a to rank b is received by the
    k-th receive on b from a (NCCL ignores tags). An op completes once it and that partner are
    both in active batches, at the later of the two batches' start times; a batch ends when all
    its ops have completed. A large send cannot finish before its receive is running, so a cycle
    of batches waiting on each other deadlocks even where ``"eager"`` finishes;
- the run deadlocks when no rank can take its next action while some still have actions left.

``check_table`` finds structural mistakes without running anything, including sends and receives
that the in-order matching of one pair of ranks would pair wrongly (``fifo_problems``); ``simulate``
runs those checks, executes the table, checks the timeline's data dependencies again, and raises
``ScheduleError`` listing every problem it found.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mega.parallel.pipeline.actions import (
    Action,
    Backward,
    Compute,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    Table,
    WeightGrad,
    label,
    p2p_batches,
    stage_place,
    transfer_of,
    virtual_stage,
)

MAX_PROBLEMS = 20  # problems listed in a ScheduleError before "... and N more"
P2P_MODES = ("eager", "rendezvous")


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
    p2p: str = "eager"  # the transfer model it ran under (one of P2P_MODES)
    weight_grad_share: float = 0.5  # of a backward, taken by its split-off WeightGrad


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
        action,
        Forward | Backward | WeightGrad | SendActivation | RecvActivation | SendGrad | RecvGrad,
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
    by exactly one receive; then, if all that holds, ``fifo_problems``."""
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
                weight = where(WeightGrad, mb, chunk)
                if len(weight) > 1:
                    problems.append(f"{name}: {len(weight)} WeightGrad, expected at most one")
                elif weight and weight[0] < bwd[0]:
                    problems.append(f"{name}: WeightGrad comes before its backward")
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
    return problems or fifo_problems(table, pp)


def _pairs(table: Table) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """For each ordered pair of ranks (a, b): the positions in a's list of its sends to b, and
    the positions in b's list of its receives from a, each in list order."""
    pairs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for rank, actions in table.items():
        for index, action in enumerate(actions):
            if isinstance(action, SendActivation | SendGrad):
                pairs.setdefault((rank, action.peer), ([], []))[0].append(index)
            elif isinstance(action, RecvActivation | RecvGrad):
                pairs.setdefault((action.peer, rank), ([], []))[1].append(index)
    return pairs


def fifo_problems(table: Table, pp: int) -> list[str]:
    """Sends and receives that in-order matching would pair wrongly, one line per pair of ranks.

    NCCL (and so the executor) ignores tags: the k-th send from rank a to rank b is received by
    the k-th receive on b from a. For every ordered pair the two sequences must therefore agree
    element by element in (kind, micro-batch, receiver's virtual stage); where they do not, a real
    run would hand a tensor to the wrong micro-batch or stage without any error. Expects a table
    whose actions are otherwise well formed (``check_table`` calls it last)."""
    problems = []
    for (src, dst), (sends, recvs) in sorted(_pairs(table).items()):
        for k, (i, j) in enumerate(zip(sends, recvs, strict=False)):
            send, recv = table[src][i], table[dst][j]
            if transfer_of(src, send, pp) != transfer_of(dst, recv, pp):
                problems.append(
                    f"rank {src} -> rank {dst}: message {k} is {send} on rank {src} but"
                    f" {recv} on rank {dst} (sends and receives between two ranks match in"
                    " order, so the wrong tensor would arrive)"
                )
                break
        else:
            if len(sends) != len(recvs):
                problems.append(
                    f"rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives"
                )
    return problems


Costs = dict[tuple[int, type, int, int], float]  # (rank, action type, micro-batch, chunk) -> cost


def _costs(table: Table, forward: float, backward: float, weight_share: float) -> Costs:
    """Every compute's duration; a backward with a split-off WeightGrad keeps only its share."""
    costs: Costs = {}
    for rank, actions in table.items():
        split = {(a.microbatch, a.chunk) for a in actions if isinstance(a, WeightGrad)}
        for a in actions:
            if isinstance(a, Forward):
                costs[rank, Forward, a.microbatch, a.chunk] = forward
            elif isinstance(a, Backward):
                share = 1.0 - weight_share if (a.microbatch, a.chunk) in split else 1.0
                costs[rank, Backward, a.microbatch, a.chunk] = backward * share
            elif isinstance(a, WeightGrad):
                costs[rank, WeightGrad, a.microbatch, a.chunk] = backward * weight_share
    return costs


def _cost(costs: Costs, rank: int, action: Compute) -> float:
    return costs[rank, type(action), action.microbatch, action.chunk]


def _weight_grads_before_receives(actions: list[Action]) -> list[Action]:
    """Eager model of weight gradients that follow a run of transfers: they start when the run is
    entered, i.e. after its sends are posted and before its receives wait."""
    result: list[Action] = []
    index = 0
    while index < len(actions):
        if isinstance(actions[index], Forward | Backward | WeightGrad):
            result.append(actions[index])
            index += 1
            continue
        end = index
        while end < len(actions) and not isinstance(actions[end], Forward | Backward | WeightGrad):
            end += 1
        after = end
        while after < len(actions) and isinstance(actions[after], WeightGrad):
            after += 1
        run = actions[index:end]
        sends = [a for a in run if isinstance(a, SendActivation | SendGrad)]
        result += sends + actions[end:after] + [a for a in run if a not in sends]
        index = after
    return result


def _run_eager(table: Table, pp: int, costs: Costs) -> tuple[dict[int, list[Slot]], list[str]]:
    """Execute the table with eager sends; per-rank timelines and the deadlock report (empty
    when it finished)."""
    table = {rank: _weight_grads_before_receives(actions) for rank, actions in table.items()}
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
                if isinstance(action, Forward | Backward | WeightGrad):
                    start = clock[rank]
                    clock[rank] = start + _cost(costs, rank, action)
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


def _batch_text(batch: tuple) -> str:
    return "[" + ", ".join(str(op) for op in batch) + "]"


def _run_rendezvous(table: Table, pp: int, costs: Costs) -> tuple[dict[int, list[Slot]], list[str]]:
    """Execute the table batch by batch (``p2p_batches``) with in-order matched, rendezvous
    transfers; per-rank timelines and the deadlock report (empty when it finished)."""
    items = {rank: p2p_batches(table[rank]) for rank in range(pp)}
    where: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, list index) -> (item, op)
    for rank in range(pp):
        index = 0
        for item_index, item in enumerate(items[rank]):
            for op_index in range(len(item) if isinstance(item, tuple) else 1):
                where[rank, index] = (item_index, op_index)
                index += 1
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (rank, item, op) both ways
    for (src, dst), (sends, recvs) in _pairs(table).items():
        for i, j in zip(sends, recvs, strict=False):
            a, b = (src, *where[src, i]), (dst, *where[dst, j])
            partner[a], partner[b] = b, a
    clock = dict.fromkeys(range(pp), 0.0)
    cursor = dict.fromkeys(range(pp), 0)
    started: dict[int, float | None] = dict.fromkeys(range(pp))  # start of the active batch
    done: dict[tuple[int, int, int], float] = {}  # completed op -> time
    # per rank: when the weight gradients run inside its active batch end, and how many they are
    overlapped: dict[int, tuple[float, int]] = {}
    timelines: dict[int, list[Slot]] = {rank: [] for rank in range(pp)}
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            while cursor[rank] < len(items[rank]):
                item = items[rank][cursor[rank]]
                if not isinstance(item, tuple):
                    start = clock[rank]
                    clock[rank] = start + _cost(costs, rank, item)
                    timelines[rank].append(Slot(start, clock[rank], item))
                    cursor[rank] += 1
                    progress = True
                    continue
                if started[rank] is None:
                    started[rank] = clock[rank]
                    progress = True
                    # the weight gradients right after the batch run while it is in flight
                    after, end = cursor[rank] + 1, clock[rank]
                    while after < len(items[rank]) and isinstance(items[rank][after], WeightGrad):
                        weight = items[rank][after]
                        begin, end = end, end + _cost(costs, rank, weight)
                        timelines[rank].append(Slot(begin, end, weight))
                        after += 1
                    overlapped[rank] = (end, after - cursor[rank] - 1)
                for op_index in range(len(item)):
                    me = (rank, cursor[rank], op_index)
                    other = partner.get(me)
                    if me in done or other is None:
                        continue
                    peer, peer_item, _ = other
                    if cursor[peer] == peer_item and started[peer] is not None:
                        done[me] = done[other] = max(started[rank], started[peer])
                        progress = True
                ends = [done.get((rank, cursor[rank], i)) for i in range(len(item))]
                if any(end is None for end in ends):
                    break  # the batch stays active until every op in it has completed
                computed, skip = overlapped[rank]
                clock[rank] = max(computed, *ends)
                started[rank] = None
                cursor[rank] += 1 + skip
                progress = True
    stuck = [rank for rank in range(pp) if cursor[rank] < len(items[rank])]
    if not stuck:
        return timelines, []
    waits = []
    for rank in stuck:
        item = items[rank][cursor[rank]]
        pending = []
        for op_index, op in enumerate(item):
            me = (rank, cursor[rank], op_index)
            if me in done:
                continue
            if me not in partner:
                pending.append(f"{op} has no matching op on rank {op.peer}")
                continue
            peer, peer_item, peer_op = partner[me]
            if cursor[peer] < len(items[peer]):
                at = items[peer][cursor[peer]]
                at = _batch_text(at) if isinstance(at, tuple) else str(at)
            else:
                at = "its end"
            pending.append(
                f"{op} needs rank {peer}'s {items[peer][peer_item][peer_op]}, but rank {peer}"
                f" is at {at}"
            )
        waits.append(f"rank {rank} waits in batch {_batch_text(item)}: " + "; ".join(pending))
    return timelines, ["deadlock (rendezvous p2p): no rank can go on (" + " | ".join(waits) + ")"]


def _makespan(timelines: dict[int, list[Slot]]) -> float:
    return max((slots[-1].end for slots in timelines.values() if slots), default=0.0)


def rendezvous_delay(table: Table, pp: int) -> float | None:
    """With unit costs, how much later a table finishes with rendezvous transfers than with eager
    ones; None if it cannot run that way (sends and receives paired wrongly, or a deadlock).
    Expects a well-formed table (``check_table``)."""
    if fifo_problems(table, pp):
        return None
    costs = _costs(table, 1.0, 1.0, 0.5)
    timelines, problems = _run_rendezvous(table, pp, costs)
    if problems:
        return None
    return _makespan(timelines) - _makespan(_run_eager(table, pp, costs)[0])


def _check_timeline(timelines: dict[int, list[Slot]], pp: int, vpp: int) -> list[str]:
    """Data dependencies, from the times: forward of stage s+1 after forward of stage s, backward
    of stage s after backward of stage s+1, and the last stage's backward after its forward."""
    end: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    for rank, slots in timelines.items():
        for slot in slots:
            kind = label(slot.action)[0]  # F, B or W
            key = (kind, slot.action.microbatch, virtual_stage(rank, slot.action.chunk, pp))
            start[key], end[key] = slot.start, slot.end
    problems = []
    last = pp * vpp - 1
    for (kind, mb, stage), begin in start.items():
        before = ("F", mb, stage - 1) if kind == "F" else ("B", mb, stage + 1)
        if kind == "B" and stage == last:
            before = ("F", mb, stage)
        if kind == "W":
            before = ("B", mb, stage)
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
    p2p: str = "eager",
    weight_grad_share: float = 0.5,
) -> SimulationResult:
    """Check and execute ``table`` under the transfer model ``p2p`` (``"eager"`` or
    ``"rendezvous"``, see the module docstring); raise ``ScheduleError`` if it is malformed,
    pairs sends and receives wrongly, deadlocks or breaks a data dependency.
    ``bubble_fraction`` = idle compute time / (pp * total time). ``weight_grad_share`` is the part
    of a backward that a split-off ``WeightGrad`` takes (tables without one ignore it)."""
    if forward_cost <= 0 or backward_cost <= 0:
        raise ValueError("forward and backward costs must be > 0")
    if not 0 < weight_grad_share < 1:
        raise ValueError(f"weight_grad_share must lie in (0, 1) (got {weight_grad_share})")
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p must be one of {', '.join(P2P_MODES)} (got {p2p!r})")
    problems = check_table(table, pp, vpp, m)
    if problems:
        raise ScheduleError(problems)
    run = _run_eager if p2p == "eager" else _run_rendezvous
    costs = _costs(table, forward_cost, backward_cost, weight_grad_share)
    timelines, problems = run(table, pp, costs)
    if problems:
        raise ScheduleError(problems)
    problems = _check_timeline(timelines, pp, vpp)
    if problems:
        raise ScheduleError(problems)
    total = _makespan(timelines)
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
        p2p=p2p,
        weight_grad_share=weight_grad_share,
    )
