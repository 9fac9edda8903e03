"""The ``flex`` MoE dispatcher (counts kept on the device) on CPU ranks: its two trips hold their
contract (tests/flex_exchange_worker.py, c10d's transport), and it refuses what it cannot do.
Its training equivalence with one process is in tests/test_moe_parallel.py (``ep*-flex*``); on
GPUs (NVSHMEM) in tests/test_gpu_moe_flex.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import run_mega, run_workers


@pytest.mark.parametrize(
    "ranks, local, transport",
    [
        (2, 2, "split"),
        (3, 1, "split"),
        (2, 1, "auto"),
        (2, 2, "padded"),
        (3, 3, "padded"),
        (2, 2, "copy-engine"),
        (2, 2, "peer-rows"),
        (3, 2, "peer-rows"),
    ],
)
def test_the_flex_trips_bring_each_block_to_its_expert_and_back(
    ranks: int, local: int, transport: str
):
    """c10d's exact splits (``split``; ``auto`` on CPU ranks) and the all-to-alls of fixed splits
    (``padded``; ``copy-engine``, which CPU ranks carry so; ``peer-rows`` with every row past
    the real ones NaN on arrival)."""
    env = {"FLEX_LOCAL": str(local), "MEGA_FLEX_TRANSPORT": transport}
    stdout = run_workers("flex_exchange_worker.py", ranks, env)
    assert stdout.count("flex trips hold their contract") == ranks, stdout[-2000:]


def test_the_race_probe_finds_no_wrong_trip_where_c10d_carries_both():
    """tests/flex_race_worker.py's own logic on CPU ranks (c10d in NVSHMEM's place): every trip
    checked, none wrong. On GPUs it probes torch's 2D kernel (tests/test_gpu_moe_flex.py)."""
    env = {"FLEX_RACE_CPU": "1", "FLEX_RACE_TRIPS": "5"}
    stdout = run_workers("flex_race_worker.py", 2, env)
    for mode in ("idle", "busy", "empty-first"):
        assert f"race probe {mode}: 5 trips on 2 ranks, 0 wrong" in stdout, stdout


def _tiny_moe_train(tmp_path: Path, *flags: str) -> Any:
    """``mega train`` of a tiny MoE on two CPU ranks with ``flags`` (run dir ``tmp_path/run``)."""
    return run_mega(
        [
            "train", "--model", "moe", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--num-experts", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "1", "--device", "cpu",
            "--nproc-per-node", "2", *flags, "--run-dir", str(tmp_path / "run"),
        ],
        tmp_path,
    )  # fmt: skip


def test_flex_refuses_a_capacity_factor(tmp_path: Path):
    """``flex`` is dropless: a capacity factor is one error line before launch."""
    result = _tiny_moe_train(
        tmp_path, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
        "--moe-expert-capacity-factor", "1.0",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: --moe-expert-capacity-factor: the flex dispatcher cannot drop tokens" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_an_unknown_flex_transport_is_one_error_line(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "carrier-pigeon")
    result = _tiny_moe_train(
        tmp_path, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: MEGA_FLEX_TRANSPORT='carrier-pigeon': must be one of auto, padded, split,"
        " copy-engine, peer-rows"
    ], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
         "error: --overlap-moe-expert-parallel-comm: only the flex dispatcher overlaps its trips"),
        (["--moe-token-dispatcher-type", "flex"],
         "error: --overlap-moe-expert-parallel-comm needs --expert-model-parallel-size above 1"),
    ],
)  # fmt: skip
def test_overlapped_trips_are_refused_where_no_trip_can_overlap(
    tmp_path: Path, flags: list[str], expected: str
):
    """Only ``flex`` overlaps its trips, and only trips between expert ranks exist to overlap:
    anything else is one error line before launch, not a flag silently ignored."""
    result = _tiny_moe_train(tmp_path, "--overlap-moe-expert-parallel-comm", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_block_cut_in_pieces_keeps_its_rows_in_order_and_its_pieces_even():
    """Each (rank, expert) count cut into ``pieces`` counts that sum to it and differ by one row
    at most, a block's pieces one after another (its rows stay in order); as many pieces as
    keep torch's kernel within 64 thread blocks and 16 sub-experts."""
    import torch

    from mega.parallel.expert.split_exchange import pieces_per_expert, split_in_pieces

    splits = torch.tensor([7, 0, 4, 1])
    pieces = split_in_pieces(splits, 3)
    assert pieces.tolist() == [3, 2, 2, 0, 0, 0, 2, 1, 1, 1, 0, 0]
    assert torch.equal(pieces.view(4, 3).sum(1), splits)
    assert split_in_pieces(splits, 1) is splits
    assert [pieces_per_expert(n, local) for n, local in [(2, 4), (4, 2), (2, 1), (8, 16)]] == [
        4, 8, 16, 1,
    ]  # fmt: skip


def test_flex_sizes_nvshmems_heap_for_its_buffers_unless_the_user_did(monkeypatch):
    """NVSHMEM's symmetric heap is fixed when it starts (1 GiB by default), and one trip's
    buffers at EP4 already take 0.8 GB: flex asks for four times its first trip's need, at least
    2 GiB, but never overrides the user's ``NVSHMEM_SYMMETRIC_SIZE``."""
    from mega.parallel.expert import split_exchange

    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    split_exchange._size_heap(800 << 20)
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(4 * (800 << 20))
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")
    split_exchange._size_heap(1 << 20)
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(2 << 30)
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "12G")
    split_exchange._size_heap(800 << 20)
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "12G"


@pytest.mark.parametrize(
    "ep, world, experts, transport, expected",
    [
        (2, 2, 8, "nccl", []),
        (2, 4, 8, "nccl", ["needs --expert-model-parallel-size equal to the number of ranks (2 of 4)"]),
        (2, 2, 64, "nccl", ["2 expert-parallel ranks of 32 local experts"]),
        (2, 2, 8, "copy-engine", ["with MEGA_CP_P2P_TRANSPORT=copy-engine"]),
    ],
)  # fmt: skip
def test_flex_on_gpus_is_refused_before_launch_where_nvshmem_cannot_carry_it(
    monkeypatch, ep, world, experts, transport, expected
):
    """NVSHMEM's kernels address ranks by their world number and synchronise every rank, take at
    most 16 ranks and 16 local experts, and the symmetric-memory backend is one per process: each
    is one line before launch (``run_checks.machine_problems`` asks on GPU runs) where NVSHMEM
    carries the trips (``MEGA_FLEX_TRANSPORT=split``)."""
    from types import SimpleNamespace

    from mega.parallel.expert.validate import flex_gpu_problems

    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "split")
    monkeypatch.setenv("MEGA_CP_P2P_TRANSPORT", transport)
    config = SimpleNamespace(
        model=SimpleNamespace(moe_token_dispatcher_type="flex", num_experts=experts),
        parallel=SimpleNamespace(expert_model_parallel_size=ep, context_parallel_size=2),
        world_size=world,
    )
    problems = flex_gpu_problems(config)
    assert len(problems) == len(expected)
    for problem, fragment in zip(problems, expected, strict=True):
        assert fragment in problem
    config.model.moe_token_dispatcher_type = "alltoall"
    assert flex_gpu_problems(config) == []


def _flex_gpu_config(ep: int, world: int, experts: int, overlap: bool = False):
    from types import SimpleNamespace

    model = SimpleNamespace(
        moe_token_dispatcher_type="flex",
        num_experts=experts,
        overlap_moe_expert_parallel_comm=overlap,
    )
    parallel = SimpleNamespace(expert_model_parallel_size=ep, context_parallel_size=1)
    return SimpleNamespace(model=model, parallel=parallel, world_size=world)


def test_the_overlap_is_refused_before_launch_on_gpus(monkeypatch):
    """On 2 H200 the overlapped trips raced over NVSHMEM and, over the padded trips, trained at
    0.48x DP2 against 0.85x in order: GPU runs get one line (``flex_gpu_problems``, asked on GPU
    runs only). ``MEGA_FLEX_OVERLAP_ON_GPUS=1`` runs it over the padded trips, never over
    NVSHMEM; CPU ranks run either (their tests)."""
    from mega.parallel.expert.validate import (
        OVERLAP_IN_ORDER_ONLY,
        OVERLAP_ON_GPUS,
        OVERLAP_OVER_NVSHMEM,
        flex_gpu_problems,
    )

    config = _flex_gpu_config(2, 2, 8, overlap=True)
    monkeypatch.delenv("MEGA_FLEX_OVERLAP_ON_GPUS", raising=False)
    for transport in ("auto", "padded", "split"):
        monkeypatch.setenv("MEGA_FLEX_TRANSPORT", transport)
        assert flex_gpu_problems(config) == [OVERLAP_ON_GPUS], transport
    monkeypatch.setenv("MEGA_FLEX_OVERLAP_ON_GPUS", "1")
    assert flex_gpu_problems(config) == [OVERLAP_OVER_NVSHMEM]
    for transport in ("auto", "padded"):
        monkeypatch.setenv("MEGA_FLEX_TRANSPORT", transport)
        assert flex_gpu_problems(config) == [], transport
    # symmetric memory's inbox carries the trips in order only, whatever
    # MEGA_FLEX_OVERLAP_ON_GPUS says
    for transport in ("copy-engine", "peer-rows"):
        monkeypatch.setenv("MEGA_FLEX_OVERLAP_ON_GPUS", "1")
        monkeypatch.setenv("MEGA_FLEX_TRANSPORT", transport)
        in_order = OVERLAP_IN_ORDER_ONLY.format(transport)
        assert transport in in_order and flex_gpu_problems(config) == [in_order]
        monkeypatch.delenv("MEGA_FLEX_OVERLAP_ON_GPUS")
        assert flex_gpu_problems(config) == [OVERLAP_ON_GPUS, in_order]
    config.model.overlap_moe_expert_parallel_comm = False
    assert flex_gpu_problems(config) == []
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "split")
    assert flex_gpu_problems(config) == []


def test_the_padded_transport_lifts_nvshmems_limits_before_launch(monkeypatch):
    """EP2 of 4 GPUs and 32 local experts: NVSHMEM (``split``) cannot (two lines), NCCL's
    fixed-split all-to-alls, the GPU default, can (none)."""
    from mega.parallel.expert.validate import flex_gpu_problems

    config = _flex_gpu_config(2, 4, 64)
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "split")
    assert len(flex_gpu_problems(config)) == 2
    for transport in ("auto", "padded"):
        monkeypatch.setenv("MEGA_FLEX_TRANSPORT", transport)
        assert flex_gpu_problems(config) == [], transport


@pytest.mark.parametrize(
    "transport, on_gpus, padded",
    [("auto", True, True), ("auto", False, False), ("padded", False, True), ("split", True, False),
     ("copy-engine", True, True), ("copy-engine", False, True)],
)  # fmt: skip
def test_auto_pads_the_trips_on_gpus_only(monkeypatch, transport, on_gpus, padded):
    """On 2 H200 the padded trips trained EP2 faster than NVSHMEM's (0.898x against 0.810x DP2,
    2026-11-30): ``auto`` takes them on GPUs; CPU ranks keep c10d's exact splits."""
    from mega.parallel.expert.validate import padded_trips

    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", transport)
    assert padded_trips(on_gpus=on_gpus) is padded


def test_a_finished_run_frees_the_symmetric_buffers_on_every_rank_before_leaving(monkeypatch):
    """NVSHMEM frees are collective: a run that ended normally frees flex's buffers at one point
    on every rank, then waits for all (``finish_job``); a process that made none does nothing."""
    import torch.distributed as dist

    from mega.parallel.distributed import finish_job
    from mega.parallel.expert import split_exchange

    barriers = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1))
    finish_job()
    assert barriers == []
    monkeypatch.setitem(split_exchange._BUFFERS, ("key",), ["a set", "another"])
    finish_job()
    assert barriers == [1] and not split_exchange.holds_buffers()


def test_the_padded_trip_refuses_splits_that_leave_rows_out():
    """Dropless: splits that count fewer rows than were sent would lose the rest quietly (they
    would ride in the padding); the padded dispatch asserts on the device that they add up."""
    import torch

    from mega.parallel.expert import padded_exchange

    rows = torch.arange(1.0, 5.0).unsqueeze(1)  # no row is zero: padding shows as 0.0
    arrived, layout = padded_exchange.dispatch(rows, torch.tensor([1, 3]), None, 1, 2)
    # each expert's room a multiple of GROUP_ALIGN (8) rows: expert 1's rows begin at row 8
    assert arrived.squeeze(1).tolist() == [1.0] + [0.0] * 7 + [2.0, 3.0, 4.0] + [0.0] * 9
    assert layout.tolist() == [[1, 3], [0, 8]]
    with pytest.raises(RuntimeError):
        padded_exchange.dispatch(rows, torch.tensor([1, 2]), None, 1, 2)


def test_the_padded_gathers_compile_to_their_eager_gradients():
    """torch 2.11's compile gave the padded transport's gather (an autograd.Function) a zero
    gradient while its forward filled its result in place (on 2 H200 and on CPU, 2026-11-30: EP2
    trained without its experts' gradients); torch 2.13 was right either way. Run under 2.11,
    this fails on the in-place fill."""
    import torch

    from mega.parallel.expert.padded_exchange import _Rows

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([2, 0, 6, 1, 5, 6, 3, 4])  # 6: a zero row
    back = torch.tensor([1, 3, 0, 6, 7, 4])  # where each row of x went

    def gather(x: torch.Tensor) -> torch.Tensor:
        return _Rows.apply(x, index, back)

    results = []
    for fn in (gather, torch.compile(gather, backend="aot_eager", fullgraph=True)):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(torch.arange(float(out.numel())).view_as(out))
        results.append((out.detach(), leaf.grad))
    (eager_out, eager_grad), (compiled_out, compiled_grad) = results
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=0, atol=0)
    assert eager_grad.abs().sum() > 0  # rows of x reached the output: a gradient to lose


def test_the_copy_engine_refusals_old_name_still_works_with_a_warning():
    from mega.parallel.expert import validate

    with pytest.warns(DeprecationWarning, match="OVERLAP_IN_ORDER_ONLY"):
        old = validate.OVERLAP_OVER_COPY_ENGINE
    assert old == validate.OVERLAP_IN_ORDER_ONLY.format("copy-engine")
