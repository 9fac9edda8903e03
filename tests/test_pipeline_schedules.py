"""Pipeline schedule tables, their simulator and ``mega schedule`` (pure Python, no torch)."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from mega.plugins.parallel.pipeline import (
    SCHEDULE_TABLES,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    TableSpec,
    analytic_bubble,
    build_table,
    check_table,
    minimum_microbatches,
    register_table,
    simulate,
    table_problems,
)
from mega.plugins.parallel.pipeline.actions import with_p2p
from mega.plugins.parallel.pipeline.tables import interleaved_order, microbatch_groups

from conftest import run_mega

BUILT_IN = ["gpipe", "1f1b", "interleaved"]


def layouts():
    """(schedule, pp, vpp) of the acceptance grid: VPP > 1 only for the interleaved schedule."""
    for name in BUILT_IN:
        for pp in (2, 3, 4, 8):
            for vpp in (1, 2, 4) if name == "interleaved" else (1,):
                yield name, pp, vpp


def forward_before_backward(result) -> None:
    for rank, slots in result.timelines.items():
        forward_end = {}
        for slot in slots:
            key = (slot.action.microbatch, slot.action.chunk)
            if isinstance(slot.action, Forward):
                forward_end[key] = slot.end
            else:
                assert key in forward_end, f"rank {rank}: {slot.action} before its forward"
                assert forward_end[key] <= slot.start


@pytest.mark.parametrize("name,pp,vpp", list(layouts()))
def test_simulation_acceptance(name, pp, vpp):
    """The issue's acceptance test: no deadlock, F before B on every stage, and the analytic
    bubble exactly when M is a multiple of PP (unit costs); otherwise finite and in [0, 1)."""
    num_layers = pp * vpp * 2
    for m in range(pp, 4 * pp + 1):
        assert table_problems(name, pp, vpp, m, num_layers) == []
        result = simulate(build_table(name, pp, vpp, m), pp, vpp, m)  # raises on deadlock
        forward_before_backward(result)
        if m % pp == 0:
            v = vpp if name == "interleaved" else 1
            expected = (pp - 1) / (v * m + pp - 1)
            assert result.bubble_fraction == expected, (m, result.bubble_fraction, expected)
            assert result.total_time == 2 * (vpp * m + pp - 1)  # exact: unit cost per chunk
        else:
            assert math.isfinite(result.bubble_fraction) and 0 <= result.bubble_fraction < 1


@pytest.mark.parametrize("name,pp,vpp", list(layouts()))
def test_bubble_is_the_analytic_one_for_every_m_at_least_pp(name, pp, vpp):
    """Stronger than Megatron: with groups of at least PP micro-batches the interleaved bubble
    stays (p-1)/(v m+p-1) when M is not a multiple of PP; 1F1B/GPipe keep theirs for any M."""
    for m in range(1 if vpp == 1 else pp, 4 * pp + 1):
        result = simulate(build_table(name, pp, vpp, m), pp, vpp, m)
        assert result.bubble_fraction == analytic_bubble(name, pp, vpp, m)


def test_unequal_costs_keep_the_closed_form():
    for name, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        result = simulate(build_table(name, 4, vpp, 8), 4, vpp, 8, forward_cost=1, backward_cost=2)
        assert result.total_time == (vpp * 8 + 3) * 3
        assert result.bubble_fraction == analytic_bubble(name, 4, vpp, 8)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 3), (2, 2, 5), (2, 4, 7), (4, 2, 6), (4, 4, 9)])
def test_interleaved_at_pp2_and_m_not_divisible_by_pp(pp, vpp, m):
    """Megatron refuses both (issues #750, #675); the tables here run."""
    assert table_problems("interleaved", pp, vpp, m, pp * vpp) == []
    result = simulate(build_table("interleaved", pp, vpp, m), pp, vpp, m)
    assert result.bubble_fraction == (pp - 1) / (vpp * m + pp - 1)


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (8, 4)])
def test_interleaved_with_fewer_microbatches_than_stages_still_runs(pp, vpp):
    for m in range(1, pp):
        assert minimum_microbatches("interleaved", pp, vpp) <= m
        forward_before_backward(simulate(build_table("interleaved", pp, vpp, m), pp, vpp, m))


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

    one_f_one_b = build_table("1f1b", 4, 1, 8)
    assert [forwards_first(one_f_one_b, r) for r in range(4)] == [4, 3, 2, 1]  # p-r-1, +1
    interleaved = build_table("interleaved", 4, 2, 8)
    assert [forwards_first(interleaved, r) for r in range(4)] == [11, 9, 7, 5]  # 2(p-r-1)+(v-1)p
    gpipe = build_table("gpipe", 3, 1, 5)
    assert [forwards_first(gpipe, r) for r in range(3)] == [5, 5, 5]


def test_table_semantics():
    table = build_table("1f1b", 2, 1, 1)
    assert table[0] == [Forward(0, 0), SendActivation(0, 0, 1), RecvGrad(0, 0, 1), Backward(0, 0)]
    assert table[1] == [RecvActivation(0, 0, 0), Forward(0, 0), Backward(0, 0), SendGrad(0, 0, 0)]
    # chunk 1 of rank 0 is virtual stage 2: its input comes from rank 1's chunk 0 (stage 1)
    table = build_table("interleaved", 2, 2, 2)
    assert RecvActivation(0, 1, 1) in table[0] and SendActivation(0, 0, 0) in table[1]
    assert check_table(table, 2, 2, 2) == []


def test_table_problems_are_actionable():
    (message,) = table_problems("interleaved", 4, 2, 8, num_layers=12)
    assert "--num-layers (12)" in message and "--pipeline-model-parallel-size" in message
    assert "--virtual-pipeline-model-parallel-size" in message
    assert (
        "--num-layers-per-virtual-pipeline-stage" in message
        and "try --num-layers 8 or 16" in message
    )
    (message,) = table_problems("1f1b", 4, 1, 8, num_layers=6)
    assert "must be divisible by --pipeline-model-parallel-size (4)" in message
    (message,) = table_problems("1f1b", 4, 2, 8)
    assert "--parallel interleaved" in message
    (message,) = table_problems("interleaved", 1, 2, 8)
    assert "--pipeline-model-parallel-size must be at least 2" in message
    (message,) = table_problems("1f1b", 4, 1, 0)
    assert "micro-batches must be at least 1" in message
    (message,) = table_problems("1f1bb", 4, 1, 8)
    assert "unknown pipeline schedule '1f1bb'" in message and "did you mean '1f1b'" in message
    with pytest.raises(ValueError, match="at least 2"):
        build_table("interleaved", 1, 2, 4)


def test_minimum_microbatches_needs_a_stricter_plugin_table():
    spec = TableSpec(
        "toy-gpipe",
        lambda pp, vpp, m: build_table("gpipe", pp, 1, m),
        "GPipe, but it wants a full pipeline",
        min_microbatches=lambda pp, vpp: pp,
    )
    register_table(spec)
    try:
        assert minimum_microbatches("toy-gpipe", 4, 1) == 4
        (message,) = table_problems("toy-gpipe", 4, 1, 3)
        assert "needs at least 4 micro-batches" in message and "--global-batch-size" in message
        assert simulate(build_table("toy-gpipe", 4, 1, 4), 4, 1, 4).total_time == 14
        with pytest.raises(ValueError, match="already registered"):
            register_table(spec)
    finally:
        SCHEDULE_TABLES.pop("toy-gpipe")


def broken(name, pp, vpp, m, edit):
    table = build_table(name, pp, vpp, m)
    edit(table)
    with pytest.raises(ScheduleError) as info:
        simulate(table, pp, vpp, m)
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
    result = simulate(with_p2p(orders, pp, 1), pp, 1, m)
    assert result.bubble_fraction == (pp - 1) / (m + pp - 1)


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
        "bubble: 0.1579 simulated (time 38 per rank, 32 busy on average);"
        " analytic (p-1)/(v*m+p-1) = 0.1579"
    )


def test_cli_pp2_interleaved_odd_microbatches(plugins):
    from mega.cli import make_cli

    args = ["schedule", "--pp", "2", "--vpp", "2", "-m", "3", "--backward-cost", "2"]
    result = CliRunner().invoke(make_cli(plugins), args)
    assert result.exit_code == 0, result.output
    assert "interleaved: 2 pipeline ranks x 2 chunks, 3 micro-batches" in result.output
    assert "B0.1---" in result.output and "bubble: 0.1429 simulated" in result.output


def read_png(path: Path) -> tuple[int, int, bytes]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc
        chunks[kind] = body
        offset += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2) and b"IEND" in chunks
    pixels = zlib.decompress(chunks[b"IDAT"])
    assert len(pixels) == height * (1 + 3 * width)
    return width, height, pixels


def test_cli_png_and_errors(tmp_path: Path):
    png = tmp_path / "timeline.png"
    args = ["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--png", str(png)]
    ok = run_mega(args, tmp_path, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "rank 3 |" in ok.stdout and f"wrote {png}" in ok.stdout
    width, height, _ = read_png(png)
    assert width > 38 * 2 and height > 4 * 20
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]  # no temporary left behind

    bad = run_mega(["schedule", "--pp", "4", "--vpp", "2", "--num-layers", "12"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("error: --num-layers (12) must be divisible")

    bad = run_mega(["schedule", "--schedule", "interleave", "--vpp", "2"], tmp_path)
    assert bad.returncode == 2
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("error: unknown pipeline schedule 'interleave'")

    bad = run_mega(["schedule", "--pp", "four"], tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1

    bad = run_mega(["schedule", "--png", str(tmp_path / "nowhere" / "x.png")], tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --png")


def test_schedule_command_does_not_import_torch(tmp_path: Path):
    code = (
        "import sys\nfrom mega.cli import main\n"
        "try:\n    main(['schedule', '--pp', '2', '--png', 'x.png'])\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "sys.stderr.write('TORCH=' + str('torch' in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.stderr.strip().endswith("TORCH=False"), result.stderr
