"""The rank layout (tp-cp-ep-dp-pp, tp innermost) and the checks that run before any launch."""

from __future__ import annotations

import pytest

from mega.core.config.resolve import resolve_config
from mega.errors import MegaUsageError
from mega.parallel.topology import build_topology, group_ranks, layout_problems

from conftest import TINY


def test_tensor_parallel_is_innermost_and_pipeline_outermost():
    groups = group_ranks(8, {"tp": 2, "cp": 1, "ep": 1, "pp": 2})
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # one model copy: tp x pp
    assert groups["cp"] == groups["ep"] == [[r] for r in range(8)]


def test_every_dimension_in_megatron_order():
    groups = group_ranks(16, {"tp": 2, "cp": 2, "ep": 1, "pp": 2})
    assert groups["cp"][0] == [0, 2]  # stride tp
    assert groups["dp"][0] == [0, 4]  # stride tp x cp
    assert groups["pp"][0] == [0, 8]  # stride tp x cp x dp
    for dim, lists in groups.items():  # each dimension partitions the world
        assert sorted(r for ranks in lists for r in ranks) == list(range(16)), dim


def test_one_process_topology_has_no_groups():
    topology = build_topology(1, 0)
    assert topology.data_parallel_size == 1 and topology.tp_rank == 0
    assert topology.group("tp") is None and topology.group("dp") is None


def test_layout_problems_name_the_sizes():
    (message,) = layout_problems(6, {"tp": 4, "cp": 1, "ep": 1, "pp": 1})
    assert "world size (6 processes)" in message and "--tensor-model-parallel-size (4)" in message
    assert layout_problems(8, {"tp": 2, "cp": 1, "ep": 1, "pp": 2}) == []


def test_every_layout_error_is_listed_at_once(plugins):
    args = [
        *TINY, "--nproc-per-node", "6", "--tensor-model-parallel-size", "4",
        "--num-attention-heads", "6", "--hidden-size", "48", "--ffn-hidden-size", "90",
        "--global-batch-size", "7", "--sequence-parallel", "--seq-length", "30",
    ]  # fmt: skip
    with pytest.raises(MegaUsageError) as raised:
        resolve_config(args, plugins)
    text = "\n".join(raised.value.messages)
    for expected in (
        "world size (6 processes) is not divisible by --tensor-model-parallel-size (4)",
        "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)",
        "--ffn-hidden-size (90) must be divisible by --tensor-model-parallel-size (4)",
        "--seq-length (30) must be divisible by --tensor-model-parallel-size (4)",
        "--global-batch-size (7) must be divisible by",
    ):
        assert expected in text, (expected, text)


def test_world_size_and_global_batch_follow_the_launch(plugins):
    config = resolve_config([*TINY, "--nproc-per-node", "4", "--global-batch-size", "16",
                             "--tensor-model-parallel-size", "2"], plugins)  # fmt: skip
    assert config.world_size == 4 and config.data_parallel_size == 2
    assert config.num_microbatches == 16 // (4 * 2)


def _shared_groups(rank: int, world_size: int, sizes: dict[str, int]) -> list[list[str]]:
    """The names of the groups that are one communicator (the same group object)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    topology = build_topology(world_size, rank, **sizes)
    names = ("tp", "cp", "ep", "dp", "edp", "dpcp", "edpcp", "tpcp", "mp")
    groups = {n: topology.group(n) for n in names if topology.group(n) is not None}
    shared: list[list[str]] = []
    for name, group in groups.items():
        for same in shared:
            if groups[same[0]] is group:
                same.append(name)
                break
        else:
            shared.append([name])
    dist.destroy_process_group()
    return [same for same in shared if len(same) > 1]


@pytest.mark.parametrize(
    "world_size, sizes, expected",
    [
        # EP2 on two ranks: ep and dp have the same ranks but each its own communicator, so the
        # gradients' reduce-scatters (dpcp) do not queue on the stream of the experts' trips (2
        # H200, 2026-11-30: one NCCL stream carried both, dpcp had taken ep's group)
        (2, {"ep": 2}, [["dp", "dpcp"]]),
        (2, {"tp": 2}, [["tp", "tpcp"]]),
        (2, {}, [["dp", "dpcp"], ["edp", "edpcp"]]),
        # with context parallelism no cp group has its counterpart's ranks: each its own (before,
        # edpcp and tpcp took cp's: the ring's trips and the experts' gradients on one stream)
        (4, {"cp": 2, "ep": 2}, []),
    ],
)
def test_a_cp_group_reuses_only_its_own_counterpart(world_size, sizes, expected):
    from mega.testing.ranks import run_ranks

    for shared in run_ranks(_shared_groups, world_size, sizes):
        assert shared == expected


def _urgent_groups(rank: int, world_size: int, sizes: dict, asked: list[str]) -> list[str]:
    """The names of the groups made with a high-priority stream asked for."""
    import torch.distributed as dist

    from mega.parallel import topology

    urgent: list = []
    made = dist.new_group

    def new_group(ranks, pg_options=None):  # noqa: ANN001, ANN202
        group = made(ranks)
        if pg_options == "urgent":
            urgent.append(group)
        return group

    dist.init_process_group("gloo")
    topology._options = lambda high: "urgent" if high else None  # gloo takes no options
    dist.new_group = new_group
    built = topology.build_topology(world_size, rank, high_priority=asked, **sizes)
    names = ("tp", "cp", "ep", "dp", "edp", "dpcp", "edpcp", "tpcp", "mp")
    found = sorted(n for n in names if any(built.group(n) is g for g in urgent))
    dist.destroy_process_group()
    return found


@pytest.mark.parametrize(
    "sizes, asked, expected",
    [
        ({}, ["dpcp"], ["dp", "dpcp"]),  # without cp, dpcp is dp's group: not ignored
        ({}, ["dp"], ["dp", "dpcp"]),
        ({"ep": 2}, ["dpcp"], ["dp", "dpcp"]),  # ep has dp's ranks, but is another group
        ({"cp": 2}, ["dpcp"], ["dpcp"]),  # with cp, its own group
    ],
)
def test_a_cp_group_asked_for_a_high_priority_stream_gets_its_counterparts(sizes, asked, expected):
    from mega.testing.ranks import run_ranks

    for urgent in run_ranks(_urgent_groups, 2, sizes, asked):
        assert urgent == expected
