"""``MEGA_FLEX_TRANSPORT=auto`` under CUDA graphs means ``peer-rows`` (on 2 H200 graphed EP2 ran
0.958-0.976x of DP2 over it against 0.93x over NCCL's padded trips; without graphs ``auto`` keeps
NCCL's): the training build sets it for the model it builds, a plan's trips see what the GPU
run's would (on the meta device both count the padded blocks at NCCL's rate), and the plan
leaves the process as it found it; the end of a job clears it."""

from __future__ import annotations

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.shadow import profile_rank
from mega.core.plugins.manager import make_plugins
from mega.parallel.expert import padded_exchange
from mega.parallel.expert.validate import AUTO_UNDER_GRAPHS, flex_transport, set_graphed_trips


@pytest.fixture
def no_transport_named(monkeypatch):
    monkeypatch.delenv("MEGA_FLEX_TRANSPORT", raising=False)
    yield monkeypatch
    set_graphed_trips(False)


def test_auto_means_peer_rows_under_graphs_and_a_named_transport_stays(no_transport_named):
    assert flex_transport() == "auto"
    set_graphed_trips(True)
    assert flex_transport() == AUTO_UNDER_GRAPHS == "peer-rows"
    no_transport_named.setenv("MEGA_FLEX_TRANSPORT", "padded")
    assert flex_transport() == "padded"
    no_transport_named.delenv("MEGA_FLEX_TRANSPORT")
    set_graphed_trips(False)
    assert flex_transport() == "auto"


def _transports_at_the_trips(graphs: list[str], monkeypatch) -> set[str]:
    seen = set()
    usable = padded_exchange.peer_rows_usable

    def recording(group, like):  # noqa: ANN001, ANN202
        seen.add(flex_transport())
        return usable(group, like)

    monkeypatch.setattr(padded_exchange, "peer_rows_usable", recording)
    argv = (
        "--model moe --num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-experts 4"
        " --moe-router-topk 2 --moe-token-dispatcher-type flex --expert-model-parallel-size 2"
        " --seq-length 64 --max-position-embeddings 64 --mock-data --tokenizer-type NullTokenizer"
        " --vocab-size 128 --micro-batch-size 2 --global-batch-size 4 --bf16 --hidden-dropout 0"
        " --attention-dropout 0 --nproc-per-node 2 --device cuda"
    ).split() + graphs
    plugins = make_plugins()
    profile_rank(resolve_config(argv, plugins, this_machine=False), plugins, 0)
    return seen


@pytest.mark.parametrize(
    "graphs, expected",
    [(["--cuda-graph-impl", "local"], {"peer-rows"}), ([], {"auto"})],
    ids=["graphs", "no-graphs"],
)
@pytest.mark.parametrize("before", [False, True], ids=["process-plain", "process-graphed"])
def test_a_plans_trips_see_the_runs_transport_and_the_process_keeps_its_own(
    no_transport_named, graphs: list[str], expected: set[str], before: bool
):
    set_graphed_trips(before)
    assert _transports_at_the_trips(graphs, no_transport_named) == expected
    assert flex_transport() == ("peer-rows" if before else "auto")


def test_the_end_of_a_job_clears_the_choice(no_transport_named):
    from mega.parallel.distributed import finish_job

    set_graphed_trips(True)
    finish_job()  # no process group, no graphs, no buffers: only the choice to clear
    assert flex_transport() == "auto"
