"""Pipeline parallelism matches a one-process run, number for number: 10 fp32 steps of an 8-layer
tiny GPT with every built-in schedule on forked gloo ranks (losses within rel 1e-5, final
parameters gathered from every stage), and the checks that stop a bad layout before launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError

from parallel_runs import EQUIVALENCE, assert_same_training, layout_run

PIPELINE = [*EQUIVALENCE, "--num-layers", "8", "--global-batch-size", "16"]  # 8 micro-batches


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return layout_run(PIPELINE, 1, str(tmp_path_factory.mktemp("single")))[0]


def pp(size: int, schedule: str, *more: str) -> list[str]:
    return ["--pipeline-model-parallel-size", str(size), "--parallel", schedule, *more]


VPP2 = ["--virtual-pipeline-model-parallel-size", "2"]
OVERLAP = "--overlap-p2p-communication"


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [
        (1, pp(1, "gpipe")),
        (2, pp(2, "gpipe")),
        (2, pp(2, "1f1b")),
        (4, pp(4, "gpipe")),
        (4, pp(4, "1f1b")),
        (2, pp(2, "interleaved", *VPP2)),
        (4, pp(4, "interleaved", "--num-layers-per-virtual-pipeline-stage", "1")),
        (2, pp(2, "1f1b", "--decoder-first-pipeline-num-layers", "3")),
        (4, pp(4, "interleaved", *VPP2, "--untie-embeddings-and-output-weights")),
        (2, pp(2, "interleaved", "--pipeline-model-parallel-layout", "Et*3|t*2|(t*2|)*1,tL")),
        (4, pp(4, "1f1b", OVERLAP)),
        (4, pp(4, "interleaved", *VPP2, OVERLAP)),
        (2, pp(2, "1f1b-zb")),
        (4, pp(4, "interleaved-zb", *VPP2)),
        (4, pp(2, "interleaved-zb", *VPP2, "--use-distributed-optimizer", "--overlap-grad-reduce")),
        (4, pp(4, "interleaved-zb", *VPP2, OVERLAP)),
    ],
    ids=[
        "pp1-gpipe", "pp2-gpipe", "pp2-1f1b", "pp4-gpipe", "pp4-1f1b", "pp2-interleaved",
        "pp4-interleaved", "pp2-uneven", "pp4-interleaved-untied", "pp2-layout",
        "pp4-1f1b-overlap-p2p", "pp4-interleaved-overlap-p2p", "pp2-1f1b-zb",
        "pp4-interleaved-zb", "pp2dp2-interleaved-zb-distopt", "pp4-interleaved-zb-overlap-p2p",
    ],
)  # fmt: skip
def test_pipeline_matches_one_process(single, tmp_path: Path, world_size, flags):
    if "--untie-embeddings-and-output-weights" in flags:
        reference = [*PIPELINE, "--untie-embeddings-and-output-weights"]
        single = layout_run(reference, 1, str(tmp_path / "one"))[0]
    results = layout_run([*PIPELINE, *flags], world_size, str(tmp_path))
    assert_same_training(single, results[0])


def test_pipeline_with_tensor_and_data_parallel(single, tmp_path: Path):
    """PP2 x TP2 x DP2 on 8 processes, interleaved, sequence parallel, distributed optimizer,
    p2p overlapped with compute."""
    flags = [
        *pp(2, "interleaved", *VPP2, OVERLAP), "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
    ]  # fmt: skip
    results = layout_run([*PIPELINE, *flags], 8, str(tmp_path))
    assert_same_training(single, results[0])


def problems(*flags: str, world: str = "4") -> str:
    args = [*PIPELINE, "--nproc-per-node", world, *flags]
    with pytest.raises(MegaUsageError) as caught:
        resolve_config(args, make_plugins())
    return "\n".join(caught.value.messages)


def test_bad_pipeline_layouts_are_refused_before_launch():
    assert "--num-layers (8) must be divisible by --pipeline-model-parallel-size (3)" in problems(
        *pp(3, "1f1b"), world="3"
    )
    assert "needs virtual stages" in problems(*pp(4, "interleaved"))
    assert "--overlap-p2p-communication needs --pipeline-model-parallel-size > 1" in problems(
        OVERLAP, world="1"
    )
    assert "x virtual stages per rank (4 x 4 = 16" in problems(
        *pp(4, "interleaved", "--virtual-pipeline-model-parallel-size", "4")
    )
    assert "first pipeline rank holds 3 layers, which do not split into 2 virtual stages" in (
        problems(
            *pp(2, "interleaved", *VPP2, "--decoder-first-pipeline-num-layers", "3"), world="2"
        )
    )
    assert "choose a pipeline schedule" in problems(*pp(4, "no-pipelining"))
    assert "need --parallel interleaved" in problems(*VPP2, world="1")
    assert "runs one model chunk per rank" in problems(*pp(4, "1f1b", *VPP2))
    layout = "--pipeline-model-parallel-layout"
    assert "places 7 layers, but --num-layers is 8" in problems(
        *pp(2, "interleaved", layout, "Et*3|t*2|t|tL"), world="2"
    )
    assert "unknown symbols x" in problems(*pp(2, "1f1b", layout, "Et*4x|t*4L"), world="2")
    assert "L (the loss) must close the last stage" in problems(
        *pp(2, "1f1b", layout, "Et*4|Lt*4"), world="2"
    )
    assert "do not add up" in problems(
        *pp(2, "1f1b", "--decoder-first-pipeline-num-layers", "9"), world="2"
    )


def test_default_schedule_follows_megatron():
    plugins = make_plugins()
    one = resolve_config(PIPELINE, plugins)
    assert one.parallel.parallel == "no-pipelining"
    staged = resolve_config([*PIPELINE, "--nproc-per-node", "2",
                             "--pipeline-model-parallel-size", "2"], plugins)  # fmt: skip
    assert staged.parallel.parallel == "1f1b"
    virtual = resolve_config([*PIPELINE, "--nproc-per-node", "2",
                              "--pipeline-model-parallel-size", "2", *VPP2], plugins)  # fmt: skip
    assert virtual.parallel.parallel == "interleaved"
