"""Pipeline schedule tables, their simulator and ``mega schedule`` (pure Python, no torch)."""

from __future__ import annotations

import importlib.util
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from mega import PipelineScheduleSpec, hookimpl
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError
from mega.parallel.pipeline import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    WeightGrad,
    build_table,
    check_table,
    fifo_problems,
    p2p_batches,
    pipeline_schedules,
    schedule_spec,
    simulate,
    table_problems,
)
from mega.parallel.pipeline.placement import _assemble, _place, with_p2p
from mega.parallel.pipeline.tables import interleaved_order, microbatch_groups
from mega.plugins.parallel.schedules import BUILTIN_SCHEDULES

from conftest import run_mega

# the schedules that split a model over pipeline ranks (no-pipelining runs one stage)
SPECS = {spec.name: spec for spec in BUILTIN_SCHEDULES if spec.max_pp != 1}
ZERO_BUBBLE = {"1f1b-zb": "1f1b", "interleaved-zb": "interleaved"}  # -> the schedule they split
BUILT_IN = list(SPECS)
MODES = ("eager", "rendezvous")


def table(name, pp, vpp, m):
    return build_table(SPECS[name], pp, vpp, m)


def forward_before_backward(result) -> None:
    """F before B, and a split-off W after its B, on every rank."""
    for rank, slots in result.timelines.items():
        forward_end, backward_end = {}, {}
        for slot in slots:
            key = (slot.action.microbatch, slot.action.chunk)
            if isinstance(slot.action, Forward):
                forward_end[key] = slot.end
            elif isinstance(slot.action, WeightGrad):
                assert backward_end[key] <= slot.start, f"rank {rank}: {slot.action} early"
            else:
                assert key in forward_end, f"rank {rank}: {slot.action} before its forward"
                assert forward_end[key] <= slot.start
                backward_end[key] = slot.end


def acceptance_grid(name, pp):
    """(vpp, m) of the acceptance grid for one schedule and PP: VPP > 1 only for interleaved
    (VPP = 1 is 1F1B), M from PP to 4 PP, and M < PP too for GPipe and 1F1B."""
    interleaved = SPECS[name].interleaved
    for vpp in (2, 4) if interleaved else (1,):
        for m in range(pp if interleaved else 1, 4 * pp + 1):
            yield vpp, m


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_simulation_acceptance(name, pp):
    """The issue's acceptance test, under both transfer models: no deadlock, F before B on every
    stage, sends and receives of every pair of ranks matched in order (FIFO), and, with unit
    costs, the analytic bubble exactly when M is a multiple of PP (both models); otherwise
    finite, in [0, 1).

    Stronger than Megatron, with eager sends: with groups of at least PP micro-batches the
    interleaved bubble stays (p-1)/(v m+p-1) when M is not a multiple of PP, and 1F1B/GPipe keep
    theirs for any M. (With rendezvous sends those M can cost a little more; it is only shown.)"""
    spec = SPECS[name]
    for vpp, m in acceptance_grid(name, pp):
        num_layers = pp * vpp * 2
        assert table_problems(spec, pp, vpp, m, num_layers) == []
        built = build_table(spec, pp, vpp, m)
        assert fifo_problems(built, pp) == []
        # the table a zero-bubble schedule splits, built once for both transfer models
        plain = build_table(SPECS[ZERO_BUBBLE[name]], pp, vpp, m) if name in ZERO_BUBBLE else None
        for mode in MODES:
            result = simulate(built, pp, vpp, m, p2p=mode)  # raises on deadlock or FIFO mismatch
            assert result.p2p == mode
            forward_before_backward(result)
            assert math.isfinite(result.bubble_fraction) and 0 <= result.bubble_fraction < 1
            if plain is not None:  # no closed form: never worse than the schedule it splits
                base = simulate(plain, pp, vpp, m, p2p=mode)
                assert result.bubble_fraction <= base.bubble_fraction, (mode, vpp, m)
                assert spec.analytic_bubble(pp, vpp, m) is None
            elif m % pp == 0:
                v = vpp if name == "interleaved" else 1
                expected = (pp - 1) / (v * m + pp - 1)
                assert result.bubble_fraction == expected, (mode, vpp, m, result.bubble_fraction)
                assert result.total_time == 2 * (vpp * m + pp - 1)  # exact: unit cost per chunk
            if mode == "eager" and name not in ZERO_BUBBLE:
                assert result.bubble_fraction == spec.analytic_bubble(pp, vpp, m), (vpp, m)


@pytest.mark.parametrize("mode", MODES)
def test_unequal_costs_keep_the_closed_form(mode):
    for name, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        built = table(name, 4, vpp, 8)
        result = simulate(built, 4, vpp, 8, forward_cost=1, backward_cost=2, p2p=mode)
        assert result.total_time == (vpp * 8 + 3) * 3
        assert result.bubble_fraction == SPECS[name].analytic_bubble(4, vpp, 8)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 3), (2, 2, 5), (2, 4, 7), (4, 2, 6), (4, 4, 9)])
def test_interleaved_at_pp2_and_m_not_divisible_by_pp(pp, vpp, m):
    """Megatron refuses both (issues #750, #675); the tables here run."""
    assert table_problems(SPECS["interleaved"], pp, vpp, m, pp * vpp) == []
    built = table("interleaved", pp, vpp, m)
    assert simulate(built, pp, vpp, m).bubble_fraction == (pp - 1) / (vpp * m + pp - 1)
    simulate(built, pp, vpp, m, p2p="rendezvous")  # runs with rendezvous transfers too


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (8, 4)])
def test_interleaved_with_fewer_microbatches_than_stages_still_runs(pp, vpp):
    for m in range(1, pp):
        assert SPECS["interleaved"].min_microbatches(pp, vpp) <= m
        for mode in MODES:
            built = table("interleaved", pp, vpp, m)
            forward_before_backward(simulate(built, pp, vpp, m, p2p=mode))


def test_interleaved_order_is_megatrons():
    """megatron.md §5: P=2, V=2, M=5, G=3 gives micro-batches 0 1 2 0 1 2 3 4 3 4, chunks
    0 0 0 1 1 1 0 0 1 1; with M = 5 mega picks groups of 3 and 2 (no group under P)."""
    assert microbatch_groups(2, 5) == [3, 2]
    order = interleaved_order(2, 2, 5)
    assert [mb for mb, _ in order] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in order] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert microbatch_groups(4, 8) == [4, 4]
    assert microbatch_groups(4, 11) == [6, 5]
    assert microbatch_groups(4, 3) == [3]


def test_warmup_lengths_are_megatrons():
    """Forwards before the first backward: the warmup W, plus the steady state's first forward."""

    def forwards_first(table, rank):
        computes = [a for a in table[rank] if isinstance(a, Forward | Backward)]
        return next(i for i, a in enumerate(computes) if isinstance(a, Backward))

    one_f_one_b = table("1f1b", 4, 1, 8)
    assert [forwards_first(one_f_one_b, r) for r in range(4)] == [4, 3, 2, 1]  # p-r-1, +1
    interleaved = table("interleaved", 4, 2, 8)
    assert [forwards_first(interleaved, r) for r in range(4)] == [11, 9, 7, 5]  # 2(p-r-1)+(v-1)p
    gpipe = table("gpipe", 3, 1, 5)
    assert [forwards_first(gpipe, r) for r in range(3)] == [5, 5, 5]


def test_table_semantics():
    built = table("1f1b", 2, 1, 1)
    assert built[0] == [Forward(0, 0), SendActivation(0, 0, 1), RecvGrad(0, 0, 1), Backward(0, 0)]
    assert built[1] == [RecvActivation(0, 0, 0), Forward(0, 0), Backward(0, 0), SendGrad(0, 0, 0)]
    # chunk 1 of rank 0 is virtual stage 2: its input comes from rank 1's chunk 0 (stage 1)
    built = table("interleaved", 2, 2, 2)
    assert RecvActivation(0, 1, 1) in built[0] and SendActivation(0, 0, 0) in built[1]
    assert check_table(built, 2, 2, 2) == []


def test_table_problems_are_actionable():
    (message,) = table_problems(SPECS["interleaved"], 4, 2, 8, num_layers=12)
    assert "--num-layers (12)" in message and "--pipeline-model-parallel-size" in message
    assert "--virtual-pipeline-model-parallel-size" in message
    assert (
        "--num-layers-per-virtual-pipeline-stage" in message
        and "try --num-layers 8 or 16" in message
    )
    (message,) = table_problems(SPECS["1f1b"], 4, 1, 8, num_layers=6)
    assert "must be divisible by --pipeline-model-parallel-size (4)" in message
    (message,) = table_problems(SPECS["1f1b"], 4, 2, 8)
    assert "--parallel interleaved" in message
    (message,) = table_problems(SPECS["interleaved"], 1, 2, 8)
    assert "--pipeline-model-parallel-size must be at least 2" in message
    (message,) = table_problems(SPECS["1f1b"], 4, 1, 0)
    assert "micro-batches must be at least 1" in message
    with pytest.raises(ValueError, match="at least 2"):
        build_table(SPECS["interleaved"], 1, 2, 4)


def test_no_pipelining_is_the_one_stage_table(plugins):
    """One schedule contract: ``no-pipelining`` is a table too, ``F0 B0 F1 B1 ...`` on one rank,
    with no transfers and no bubble; it refuses a second pipeline rank."""
    spec = plugins.parallel.get("no-pipelining")
    assert spec.table(1, 1, 3) == {
        0: [Forward(0), Backward(0), Forward(1), Backward(1), Forward(2), Backward(2)]
    }
    assert simulate(spec.table(1, 1, 3), 1, 1, 3).bubble_fraction == 0
    (message,) = table_problems(spec, 2, 1, 4)
    assert "--pipeline-model-parallel-size must be at most 1 for 'no-pipelining'" in message


def test_schedules_are_parallel_plugins(plugins):
    """The built-ins come in through the ``mega`` entry points as ``PipelineScheduleSpec``s in
    the parallel registry, next to ``no-pipelining``; ``schedule_spec`` finds only those."""
    assert sorted(pipeline_schedules(plugins)) == [
        "1f1b", "1f1b-zb", "gpipe", "interleaved", "interleaved-zb"
    ]  # fmt: skip
    assert plugins.parallel.provider("1f1b") == "pipeline_schedules"
    assert schedule_spec(plugins, "interleaved") is plugins.parallel.get("interleaved")
    with pytest.raises(MegaUsageError) as info:
        schedule_spec(plugins, "1f1bb")
    (message,) = info.value.messages
    assert "unknown pipeline schedule '1f1bb'" in message and "did you mean '1f1b'" in message
    assert "no-pipelining" in plugins.parallel
    with pytest.raises(MegaUsageError) as info:
        schedule_spec(plugins, "no-pipelining")
    (message,) = info.value.messages
    assert message.startswith("'no-pipelining' is not a pipeline schedule")
    assert "1f1b, 1f1b-zb, gpipe, interleaved, interleaved-zb" in message


def test_import_is_torch_free_and_cheap():
    code = (
        "import sys, time\nstart = time.perf_counter()\n"
        "import mega.plugins.parallel.schedules\n"
        "print(time.perf_counter() - start, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    seconds, torch = result.stdout.split()
    assert torch == "False" and float(seconds) < 0.5, result.stdout


class ToyGPipe:
    """A third-party schedule: GPipe, but it wants a full pipeline."""

    spec = PipelineScheduleSpec(
        name="toy-gpipe",
        table=lambda pp, vpp, m: table("gpipe", pp, 1, m),
        description="GPipe, but it wants a full pipeline",
        min_microbatches=lambda pp, vpp: pp,
    )

    @hookimpl
    def register_parallel_choices(self, register):
        register(self.spec)


def test_minimum_microbatches_needs_a_stricter_plugin_table():
    plugins = make_plugins(extra=[("toy", ToyGPipe())])
    spec = schedule_spec(plugins, "toy-gpipe")
    assert spec.min_microbatches(4, 1) == 4
    (message,) = table_problems(spec, 4, 1, 3)
    assert "needs at least 4 micro-batches" in message and "--global-batch-size" in message
    assert simulate(build_table(spec, 4, 1, 4), 4, 1, 4).total_time == 14
    twice = make_plugins(extra=[("toy", ToyGPipe()), ("toy-again", ToyGPipe())])
    (problem,) = twice.problems
    assert "'toy-gpipe' is registered by two plugins" in problem


def test_a_plugin_schedule_runs_in_mega_schedule():
    from mega.cli import make_cli

    plugins = make_plugins(extra=[("toy", ToyGPipe())])
    args = ["schedule", "--schedule", "toy-gpipe", "--pp", "4", "-m", "4", "--p2p", "rendezvous"]
    result = CliRunner().invoke(make_cli(plugins), args)
    assert result.exit_code == 0, result.output
    assert "toy-gpipe: 4 pipeline ranks x 1 chunk, 4 micro-batches" in result.output
    assert "bubble: 0.4286 simulated" in result.output
    result = CliRunner().invoke(make_cli(plugins), [*args[:-4], "-m", "3"])
    assert isinstance(result.exception, MegaUsageError)  # `mega` prints it as one error line
    assert "needs at least 4 micro-batches" in str(result.exception)


def broken(name, pp, vpp, m, edit, p2p="eager"):
    built = table(name, pp, vpp, m)
    edit(built)
    with pytest.raises(ScheduleError) as info:
        simulate(built, pp, vpp, m, p2p=p2p)
    return str(info.value)


def test_simulator_catches_broken_tables():
    def drop_send(table):
        table[0].remove(SendActivation(1, 0, 1))

    assert "0 sends but 1 receives" in broken("1f1b", 2, 1, 2, drop_send)

    def backward_first(table):
        last = table[1]
        i, j = last.index(Forward(0, 0)), last.index(Backward(0, 0))
        last[i], last[j] = last[j], last[i]

    assert "backward comes before its forward" in broken("1f1b", 2, 1, 2, backward_first)

    def wait_for_grad_before_sending(table):  # well formed, but both ranks wait for each other
        table[0] = [RecvGrad(0, 0, 1), Forward(0, 0), SendActivation(0, 0, 1), Backward(0, 0)]

    message = broken("1f1b", 2, 1, 1, wait_for_grad_before_sending)
    assert message.startswith("deadlock") and "rank 0 waits at RecvGrad" in message

    def receive_after_use(table):
        i = table[1].index(RecvActivation(0, 0, 0))
        table[1][i], table[1][i + 1] = table[1][i + 1], table[1][i]

    message = broken("1f1b", 2, 1, 1, receive_after_use)
    assert "RecvActivation is not before its forward" in message

    def wrong_peer(table):
        table[0][table[0].index(SendActivation(0, 0, 1))] = SendActivation(0, 0, 2)

    assert "virtual stage 1 is on rank 1, not 2" in broken("1f1b", 3, 1, 1, wrong_peer)

    def twice(table):
        table[2].append(Backward(0, 0))

    assert "1 forwards and 2 backwards" in broken("gpipe", 3, 1, 2, twice)

    def missing_rank(table):
        del table[1]

    assert "expected 0..2" in broken("gpipe", 3, 1, 2, missing_rank)


def test_a_plugin_table_is_checked_like_a_built_in():
    """Backwards in reverse order (last-in first-out GPipe) is another valid table."""
    pp, m = 3, 4
    orders = {
        rank: [*(Forward(mb) for mb in range(m)), *(Backward(mb) for mb in reversed(range(m)))]
        for rank in range(pp)
    }
    for mode in MODES:
        result = simulate(with_p2p(orders, pp, 1), pp, 1, m, p2p=mode)
        assert result.bubble_fraction == (pp - 1) / (m + pp - 1)


def test_p2p_batches_groups_runs_of_transfers():
    """What the executor issues: one batch_isend_irecv per maximal run of sends and receives."""
    actions = [
        RecvActivation(0, 0, 0),
        Forward(0),
        SendActivation(0, 0, 2),
        RecvGrad(0, 0, 2),
        RecvActivation(1, 0, 0),
        Backward(0),
        Forward(1),
        SendGrad(0, 0, 0),
    ]
    assert p2p_batches(actions) == [
        (RecvActivation(0, 0, 0),),
        Forward(0),
        (SendActivation(0, 0, 2), RecvGrad(0, 0, 2), RecvActivation(1, 0, 0)),
        Backward(0),
        Forward(1),
        (SendGrad(0, 0, 0),),
    ]
    assert p2p_batches([]) == [] and p2p_batches([Forward(0)]) == [Forward(0)]
    # interleaved, steady state: one batch per (forward, backward) pair, as Megatron's
    # send_forward_backward_recv_forward_backward
    items = p2p_batches(table("interleaved", 4, 2, 8)[3])
    assert items[21:24] == [
        Forward(4, 0),
        Backward(0, 0),
        (SendGrad(0, 0, 2), SendActivation(4, 0, 0), RecvActivation(5, 0, 2), RecvGrad(1, 0, 0)),
    ]


@pytest.mark.parametrize("mode", MODES)
def test_fifo_mismatch_is_reported(mode):
    """NCCL pairs the k-th send from a to b with the k-th receive on b from a: receiving the
    micro-batches in another order than they were sent would silently swap the tensors."""

    def receive_both_first(built):
        last = built[1]
        last.remove(RecvActivation(1, 0, 0))
        last.insert(0, RecvActivation(1, 0, 0))  # before RecvActivation(0, ...)

    assert check_table(table("gpipe", 2, 1, 2), 2, 1, 2) == []
    message = broken("gpipe", 2, 1, 2, receive_both_first, mode)
    assert message.startswith("rank 0 -> rank 1: message 0 is SendActivation(microbatch=0")
    assert "but RecvActivation(microbatch=1, chunk=0, peer=0) on rank 1" in message


def test_rendezvous_deadlock_that_eager_sends_hide():
    """Interleaved 1F1B with each receive just before its compute and each send just after (the
    tables before the rendezvous model): fine with eager sends, but with NCCL every rank sits in
    a batch sending a gradient to its predecessor, which is itself sending. ``with_p2p`` groups
    the steady state's transfers as Megatron does, so the built-in table runs either way."""
    pp, vpp, m = 4, 2, 8
    built = table("interleaved", pp, vpp, m)
    orders = {rank: [a for a in built[rank] if isinstance(a, Forward | Backward)] for rank in built}
    naive = _assemble(*_place(orders, pp, vpp, None)[:2], pp)
    assert simulate(naive, pp, vpp, m).bubble_fraction == 3 / 19
    with pytest.raises(ScheduleError) as info:
        simulate(naive, pp, vpp, m, p2p="rendezvous")
    message = str(info.value)
    assert message.startswith("deadlock (rendezvous p2p): no rank can go on")
    for rank in range(pp):
        assert f"rank {rank} waits in batch [SendGrad(" in message
    assert "needs rank 3's RecvGrad(microbatch=0, chunk=0, peer=0), but rank 3 is at" in message
    assert simulate(built, pp, vpp, m, p2p="rendezvous").bubble_fraction == 3 / 19


def test_pp2_interleaved_fifo_needs_the_pairs_ordered():
    """With PP = 2 both neighbours are one peer, so activations and gradients share a channel;
    with M = 5 the naive placement sends the gradient of micro-batch 0 before the activation of
    micro-batch 3 while the peer wants them the other way round."""
    pp, vpp, m = 2, 2, 5
    built = table("interleaved", pp, vpp, m)
    orders = {rank: [a for a in built[rank] if isinstance(a, Forward | Backward)] for rank in built}
    (problem,) = fifo_problems(_assemble(*_place(orders, pp, vpp, None)[:2], pp), pp)
    assert problem.startswith("rank 0 -> rank 1: message 6 is SendGrad(microbatch=0, chunk=1")
    assert fifo_problems(built, pp) == []


def test_unknown_p2p_mode():
    with pytest.raises(ValueError, match="eager, rendezvous"):
        simulate(table("1f1b", 2, 1, 2), 2, 1, 2, p2p="lazy")


# ------------------------------------------------------------------------------------ the CLI


def test_cli_prints_every_rank_and_the_bubble(plugins):
    from mega.cli import make_cli

    args = [
        "schedule",
        "--pp",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "8",
        "--schedule",
        "interleaved",
    ]
    result = CliRunner().invoke(make_cli(plugins), [*args, "--width", "100"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for rank in range(4):
        assert any(line.startswith(f"rank {rank} |F") for line in lines)
    assert "F3.1" in result.output and "B7.0" in result.output
    assert all(len(line) <= 100 for line in lines)
    assert lines[-1] == (
        "bubble: 0.1579 simulated (time 38 per rank, 32 busy on average); analytic 0.1579"
    )


@pytest.mark.parametrize("mode", MODES)
def test_cli_pp2_interleaved_odd_microbatches(plugins, mode):
    from mega.cli import make_cli

    args = ["schedule", "--pp", "2", "--vpp", "2", "-m", "3", "--backward-cost", "2"]
    result = CliRunner().invoke(make_cli(plugins), [*args, "--p2p", mode])
    assert result.exit_code == 0, result.output
    assert "interleaved: 2 pipeline ranks x 2 chunks, 3 micro-batches" in result.output
    assert f"checked: finishes with {mode} p2p" in result.output
    assert "B0.1---" in result.output and "bubble: 0.1429 simulated" in result.output
    bad = CliRunner().invoke(make_cli(plugins), [*args, "--p2p", "lazy"])
    assert bad.exit_code == 2 and "'lazy' is not one of 'eager', 'rendezvous'" in bad.output


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib (mega[plot])")


def read_png(path: Path) -> tuple[int, int, bytes]:
    """(width, height, decompressed image data) of a PNG, its chunks' checksums verified."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc
        chunks[kind] = chunks.get(kind, b"") + body  # IDAT may come in several chunks
        offset += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert b"IEND" in chunks
    return width, height, zlib.decompress(chunks[b"IDAT"])


@needs_matplotlib
def test_cli_png_is_a_labelled_timeline(tmp_path: Path):
    png = tmp_path / "timeline.png"
    args = ["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8"]
    ok = run_mega([*args, "--png", str(png)], tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "rank 3 |" in ok.stdout and f"wrote {png}" in ok.stdout
    width, height, pixels = read_png(png)
    assert 800 <= width <= 6100 and 250 <= height <= 1200, (width, height)
    assert len(set(pixels)) > 50  # a picture, not a blank page
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]  # no temporary left behind

    # the same picture as SVG keeps its text: rank labels, every box's label, the axis, the title
    svg = tmp_path / "timeline.svg"
    ok = run_mega([*args, "--png", str(svg)], tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for label in ["rank 0", "rank 3", "F0.0", "B7.1", "F7.1", "time (units of"]:
        assert f">{label}" in text, label
    assert "interleaved: 4 pipeline ranks x 2 chunks, 8 micro-batches" in text

    zb = tmp_path / "zb.svg"
    args = ["schedule", "--schedule", "1f1b-zb", "--pp", "2", "-m", "4", "--png", str(zb)]
    assert run_mega(args, tmp_path, timeout=120).returncode == 0
    assert ">W3<" in zb.read_text() and ">W weight gradients<" in zb.read_text()


def test_cli_png_without_matplotlib_is_one_line(tmp_path: Path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for a test')\n")
    env = {"PYTHONPATH": str(blocker)}
    out = tmp_path / "x.png"
    bad = run_mega(["schedule", "--pp", "2", "--png", str(out)], tmp_path, env=env)
    assert bad.returncode == 2, bad.stderr
    (line,) = bad.stderr.strip().splitlines()
    assert (
        line
        == "error: --png needs matplotlib: pip install 'mega[plot]' (or pip install matplotlib)"
    )
    assert not out.exists() and "rank 1 |" not in bad.stdout


def test_cli_png_and_errors(tmp_path: Path):
    bad = run_mega(["schedule", "--pp", "4", "--vpp", "2", "--num-layers", "12"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("error: --num-layers (12) must be divisible")

    bad = run_mega(["schedule", "--schedule", "interleave", "--vpp", "2"], tmp_path)
    assert bad.returncode == 2
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("error: unknown pipeline schedule 'interleave'")

    bad = run_mega(["schedule", "--schedule", "no-pipelining"], tmp_path)
    assert bad.returncode == 2
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("error: 'no-pipelining' is not a pipeline schedule")

    bad = run_mega(["schedule", "--pp", "four"], tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1

    bad = run_mega(["schedule", "--png", str(tmp_path / "nowhere" / "x.png")], tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --png")
    bad = run_mega(["schedule", "--png", str(tmp_path / "x.gif")], tmp_path)
    assert bad.returncode == 2 and "cannot write .gif files" in bad.stderr


def test_schedule_command_does_not_import_torch(tmp_path: Path):
    png = ", '--png', 'x.png'" if HAS_MATPLOTLIB else ""
    code = (
        "import sys\nfrom mega.cli import main\n"
        f"try:\n    main(['schedule', '--pp', '2'{png}])\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "sys.stderr.write('TORCH=' + str('torch' in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.stderr.strip().endswith("TORCH=False"), result.stderr


def test_split_weight_grads_places_each_w_after_the_transfers_that_follow_its_backward():
    built = table("1f1b-zb", 2, 1, 4)
    rank0 = built[0]
    for index, action in enumerate(rank0):
        if isinstance(action, WeightGrad):
            before = rank0[:index]
            assert Backward(action.microbatch) in before
            # between its backward and it: only transfers and other weight gradients
            back = before.index(Backward(action.microbatch))
            assert not any(isinstance(a, Forward | Backward) for a in rank0[back + 1 : index])
    # one W per backward, and the batches are the plain schedule's, in the same order
    plain = table("1f1b", 2, 1, 4)
    for rank in (0, 1):
        assert sum(isinstance(a, WeightGrad) for a in built[rank]) == 4
        assert [a for a in built[rank] if not isinstance(a, WeightGrad)] == plain[rank]


@pytest.mark.parametrize("mode", MODES)
def test_zero_bubble_split_finishes_sooner_when_backward_dominates(mode):
    """With backward twice the forward, the input gradient reaches the previous stage a
    weight-gradient GEMM sooner and the weight gradients fill waits: the step is shorter."""
    for name, plain_name, vpp in (("1f1b-zb", "1f1b", 1), ("interleaved-zb", "interleaved", 2)):
        split = simulate(table(name, 4, vpp, 8), 4, vpp, 8, 1, 2, p2p=mode)
        plain = simulate(table(plain_name, 4, vpp, 8), 4, vpp, 8, 1, 2, p2p=mode)
        assert split.total_time < plain.total_time
        busy = sum(s.end - s.start for slots in split.timelines.values() for s in slots)
        assert busy == pytest.approx(4 * 8 * vpp * 3)  # the same work, only moved


def test_misplaced_weight_grads_are_reported():
    built = table("1f1b-zb", 2, 1, 2)
    early = {0: [WeightGrad(0), *(a for a in built[0] if a != WeightGrad(0))], 1: built[1]}
    twice = {0: [*built[0], WeightGrad(1)], 1: built[1]}
    assert any("WeightGrad comes before its backward" in p for p in check_table(early, 2, 1, 2))
    assert any("2 WeightGrad, expected at most one" in p for p in check_table(twice, 2, 1, 2))
