"""One contract per parallel dimension (``mega.ParallelDimension``): a dimension mega does not
have lands as a plugin, touching no existing file. The toy below is defined in this file only:
``rc`` (replica check) runs the same micro-batches on every rank of its group and stops the run
when their losses differ, as a check for silent data corruption would. It uses the contract's
parts: its own coordinate and process group (``--extra-parallel-size rc=2``), validation,
``apply`` (replicas compare their weights once built), a micro-batch step (where the test
corrupts one replica's data), the loss share (the comparison) and iteration-line metrics.

Its numbers are compared with one process's: replicas of the same data train exactly as one
rank does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from mega import MegaRunError, MegaUsageError, ParallelDimension, hookimpl
from mega.parallel.dimensions import BUILT_IN
from mega.parallel.topology import JOINS, Topology, build_topology, group_ranks
from mega.testing.commands import TINY_GPT, with_free_port

from conftest import lm_losses


def replicas_agree(value: Any, group: Any) -> bool:
    """Whether every rank of ``group`` holds ``value`` (a tensor), bit for bit."""
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, value.contiguous(), group=group)
    return all(torch.equal(other, gathered[0]) for other in gathered)


@dataclass(frozen=True, kw_only=True)
class ReplicaCheck(ParallelDimension):
    name: str = "rc"
    description: str = "replicas of the same data, compared every micro-batch (a test's toy)"
    corrupt_rank: int | None = None  # this rc rank's tokens are changed (a fault, simulated)
    checks: list = None  # micro-batch comparisons since the last iteration line, per process

    def problems(self, config: Any, plan: Any, plugins: Any) -> list[str]:
        size = config.parallel.extra_sizes().get(self.name, 1)
        if config.parallel.tensor_model_parallel_size > 1 and size > 1:
            return [
                "--extra-parallel-size rc: the toy replica check runs without tensor parallelism"
            ]
        return []

    def apply(self, model: Any, plan: Any, parallel: Any, topology: Any, choices: Any) -> None:
        import torch

        group = topology.group(self.name)
        if group is None:
            return
        total = torch.stack([p.detach().double().sum() for p in model.parameters()])
        if not replicas_agree(total, group):
            raise MegaRunError("replica check: the replicas were built with different weights")

    def prepare_microbatch(self, topology: Any) -> Any:
        if self.corrupt_rank is None or topology.group_rank(self.name) != self.corrupt_rank:
            return None

        def corrupt(arrays: dict) -> dict:
            tokens = arrays["tokens"].copy()
            tokens[0, 0] = (tokens[0, 0] + 1) % 50  # one token flipped
            return {**arrays, "tokens": tokens}

        return corrupt

    def share_loss(self, loss: Any, topology: Any) -> Any:
        group = topology.group(self.name)
        if group is None:
            return loss

        def compared(output: Any, microbatch: dict) -> Any:
            parts = loss(output, microbatch)
            if not replicas_agree(parts.detach(), group):
                raise MegaRunError("replica check: the replicas' losses differ")
            self.checks.append(1)
            return parts

        return compared

    def metrics(self, model: Any, topology: Any) -> dict[str, Any]:
        if topology.group(self.name) is None:
            return {}
        done = len(self.checks)
        self.checks.clear()
        return {"replica_checks": done}


class ToyDimension:
    def __init__(self, **options: Any) -> None:
        self.dimension = ReplicaCheck(checks=[], **options)

    @hookimpl
    def register_parallel_choices(self, register):
        register(self.dimension)


def train_args(tmp_path, *extra: str) -> list[str]:
    return [
        "train", *TINY_GPT, "--train-iters", "3", "--mock-data",
        "--run-dir", str(tmp_path / "run"), *extra,
    ]  # fmt: skip


@pytest.fixture
def forked(monkeypatch):
    # forked ranks run with the launching mega's plugins (the toy is an object of this test)
    monkeypatch.setenv("MEGA_START_METHOD", "fork")


def test_a_replica_dimension_trains_exactly_as_one_process(mega_cli, tmp_path, forked):
    one = mega_cli(train_args(tmp_path / "one"))
    assert one.exit_code == 0, one.stderr
    args = train_args(tmp_path, "--nproc-per-node", "2", "--extra-parallel-size", "rc=2")
    two = mega_cli(with_free_port(args), ToyDimension())
    assert two.exit_code == 0, two.stderr
    assert "world 2 = dp 1 x rc 2 x pp 1 x cp 1 x tp 1" in two.output, two.output
    assert lm_losses(two.output) == lm_losses(one.output) and len(lm_losses(one.output)) == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    # two micro-batches a step (global batch 8 of micro-batch 4, one data-parallel rank)
    assert [r["replica_checks"] for r in records if "replica_checks" in r] == [2, 2, 2]


def test_a_replica_that_reads_other_data_stops_the_run(mega_cli, tmp_path, forked):
    args = train_args(tmp_path, "--nproc-per-node", "2", "--extra-parallel-size", "rc=2")
    failed = mega_cli(with_free_port(args), ToyDimension(corrupt_rank=1))
    assert failed.exit_code == 1, (failed.output, failed.stderr)
    assert "replica check: the replicas' losses differ" in failed.stderr, failed.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--extra-parallel-size", "xx=2"],
            "--extra-parallel-size: no parallel dimension 'xx' (have: rc)",
        ),
        (["--extra-parallel-size", "rc"], "--extra-parallel-size: 'rc' is not NAME=SIZE"),
        (["--extra-parallel-size", "tp=2"], "'tp' is a built-in dimension"),
        (["--extra-parallel-size", "rc=3"], "not divisible by --extra-parallel-size rc=3"),
        (
            [
                "--extra-parallel-size",
                "rc=2",
                "--tensor-model-parallel-size",
                "2",
                "--nproc-per-node",
                "4",
            ],
            "the toy replica check runs without tensor parallelism",
        ),
    ],
)
def test_bad_dimension_flags_are_one_error_line(mega_cli, tmp_path, flags, message):
    result = mega_cli([*train_args(tmp_path), "--nproc-per-node", "2", *flags], ToyDimension())
    assert result.exit_code == 2, (result.output, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_plugin_dimension_gets_a_coordinate_between_expert_and_data():
    groups = group_ranks(8, {"tp": 2, "cp": 1, "ep": 1, "pp": 1, "rc": 2}, {"rc": ("mp",)})
    assert groups["rc"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the replicas hold the same data
    assert groups["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # it joined mp
    topology = Topology(world_size=8, tensor_model_parallel_size=2, extra_sizes={"rc": 2})
    assert topology.data_parallel_size == 2 and topology.extra_sizes == {"rc": 2}
    with pytest.raises(ValueError, match="may join only"):
        build_topology(2, 0, extra={"rc": 2}, joins={"rc": ("dp",)})


def test_the_built_in_dimensions_declare_the_topologys_joins():
    assert [d.name for d in BUILT_IN] == ["tp", "ep", "cp"]  # the order they are applied in
    assert all(d.joins == JOINS[d.name] for d in BUILT_IN)


def test_a_dimension_plugin_registers_through_the_choices_hook(mega_plugins):
    plugins = mega_plugins(ToyDimension())
    assert plugins.choices("parallel dimension").names() == ["rc"]
    with pytest.raises(MegaUsageError):
        plugins.choices("parallel dimension").get("nope")
