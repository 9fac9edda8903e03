"""``--cuda-graph-impl local`` refuses what a CUDA graph replay would get wrong or was never
measured with, one line each (mega.core.config.cuda_graph_checks). Checked as the launcher
checks a run for a GPU machine (``on_cpu=False``): this machine has no GPU."""

from __future__ import annotations

import pytest

from mega.core.config.cuda_graph_checks import cuda_graph_problems
from mega.core.config.resolve import resolve_config
from mega.testing import TINY_GPT
from mega.testing.commands import make_test_plugins

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def graphs_config(*args: str) -> object:
    """The run of ``args`` for a GPU machine (as ``mega plan`` resolves one), then asking for
    graphs (resolving with the flag would raise on the problems this checks)."""
    config = resolve_config([*args, "--device", "cuda"], make_test_plugins(), this_machine=False)
    config.training.cuda_graph_impl = "local"
    return config


def problems(*args: str, on_cpu: bool = False) -> list[str]:
    return cuda_graph_problems(graphs_config(*TINY_GPT, *args), on_cpu=on_cpu)


def test_a_dense_tensor_parallel_run_without_dropout_may_use_graphs():
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--nproc-per-node", "2"]
    assert problems(*NO_DROPOUT, *tp2) == []


def test_none_asks_nothing():
    config = resolve_config(
        [*TINY_GPT, "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"],
        make_test_plugins(),
    )
    assert cuda_graph_problems(config, on_cpu=True) == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "--hidden-dropout 0.1 and --attention-dropout 0.1 given"),
        ([*NO_DROPOUT, "--no-compile"], "replays the compiled layers: drop --no-compile"),
        ([*NO_DROPOUT, "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"], "--pipeline-model-parallel-size"),
        ([*NO_DROPOUT, "--context-parallel-size", "2", "--nproc-per-node", "2"], "--context-parallel-size"),
        ([*NO_DROPOUT, "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
         "--recompute-granularity full"),
    ],
)  # fmt: skip
def test_each_refusal_names_its_flag(args, fragment):
    found = problems(*args)
    assert len(found) == 1 and fragment in found[0], found


MOE = ["--model", "moe", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--num-experts", "4", "--seq-length", "32", *NO_DROPOUT]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [[], ["--moe-token-dispatcher-type", "alltoall"],
     ["--moe-token-dispatcher-type", "flex", "--overlap-moe-expert-parallel-comm",
      "--expert-model-parallel-size", "2", "--nproc-per-node", "2"]],
    ids=["allgather", "alltoall", "flex-overlapped"],
)  # fmt: skip
def test_moe_is_refused_unless_flex_in_order(args):
    found = cuda_graph_problems(graphs_config(*MOE, *args), on_cpu=False)
    assert len(found) == 1 and "an MoE model unless its tokens go by" in found[0], found


def test_moe_flex_over_nvshmem_is_refused(monkeypatch):
    config = graphs_config(*MOE, "--moe-token-dispatcher-type", "flex")
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "split")
    found = cuda_graph_problems(config, on_cpu=False)
    assert (
        len(found) == 1 and "MEGA_FLEX_TRANSPORT auto, padded, copy-engine or peer-rows" in found[0]
    ), found


@pytest.mark.parametrize("transport", ["auto", "padded", "copy-engine", "peer-rows"])
def test_moe_flex_over_the_padded_trips_may_use_graphs(monkeypatch, transport):
    """Whatever carries the padded blocks: NCCL, or the inbox whose tokens end where they began."""
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", transport)
    ep2 = ["--expert-model-parallel-size", "2", "--nproc-per-node", "2"]
    assert (
        cuda_graph_problems(
            graphs_config(*MOE, "--moe-token-dispatcher-type", "flex", *ep2), on_cpu=False
        )
        == []
    )


def test_the_cpu_is_refused():
    assert problems(*NO_DROPOUT, on_cpu=True) == [
        "--cuda-graph-impl local needs CUDA GPUs (the run is on the CPU)"
    ]
