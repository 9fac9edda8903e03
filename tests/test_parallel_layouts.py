"""Every parallel layout matches a one-process run, number for number: 10 fp32 steps of a tiny GPT
on forked gloo ranks against the same run on one rank (losses within rel 1e-5, final parameters
gathered to global tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_runs import EQUIVALENCE, assert_same_training, layout_run


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return layout_run(EQUIVALENCE, 1, str(tmp_path_factory.mktemp("single")))[0]


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [
        (2, []),
        (2, ["--overlap-grad-reduce", "--ddp-bucket-size", "5000"]),
        (4, ["--use-distributed-optimizer"]),
        (4, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "5000"]),
    ],
    ids=["dp2", "dp2-overlap", "dp4-distopt", "dp4-distopt-overlap"],
)
def test_data_parallel_matches_one_process(single, tmp_path: Path, world_size, flags):
    results = layout_run([*EQUIVALENCE, *flags], world_size, str(tmp_path))
    assert_same_training(single, results[0])
    # every rank logged the same, data-parallel-averaged losses
    assert all(r["losses"] == results[0]["losses"] for r in results)
    if "--ddp-bucket-size" in flags:
        assert results[0]["engine_buckets"] > 2  # the overlap really had several buckets


def test_distributed_optimizer_shards_the_state(single, tmp_path: Path):
    """Adam moments (and fp32 masters in bf16) per rank at DP=4 are about a quarter of DP=1's."""
    for precision in ([], ["--bf16"]):
        args = [*EQUIVALENCE, *precision, "--train-iters", "1"]
        one = layout_run(args, 1, str(tmp_path / "one"))[0]["state_bytes"]
        sharded = layout_run([*args, "--use-distributed-optimizer"], 4, str(tmp_path / "four"))
        worst = max(r["state_bytes"] for r in sharded)
        assert worst <= 0.26 * one, (precision, worst, one)


TP2 = ["--tensor-model-parallel-size", "2"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [
        (2, TP2),
        (2, [*TP2, "--sequence-parallel"]),
        (4, [*TP2, "--use-distributed-optimizer"]),
        (4, [*TP2, "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce"]),
        (2, [*TP2, *FULL_RECOMPUTE, "--recompute-num-layers", "1"]),
        (2, [*TP2, "--sequence-parallel", "--recompute-granularity", "selective"]),
        (2, [*TP2, "--compile"]),
        (2, [*TP2, "--sequence-parallel", "--compile"]),
        (2, [*TP2, *FULL_RECOMPUTE, "--recompute-num-layers", "1", "--compile"]),
    ],
    ids=["tp2", "tp2-sp", "tp2-dp2-distopt", "tp2-sp-dp2-distopt-overlap", "tp2-full-recompute",
         "tp2-sp-selective-recompute", "tp2-compile", "tp2-sp-compile",
         "tp2-full-recompute-compile"],
)  # fmt: skip
def test_tensor_parallel_matches_one_process(single, tmp_path: Path, world_size, flags):
    """The byte tokenizer's 257 ids pad to 384 rows at TP=1 and 512 at TP=2: the padding is masked
    out of the softmax, so the runs still agree. The compiled layouts trace the functional
    collectives into the layers' graphs (on gloo the old in-place ones traced correctly too: only
    tests/test_gpu_compiled_parallel.py tells them apart)."""
    results = layout_run([*EQUIVALENCE, *flags], world_size, str(tmp_path))
    assert_same_training(single, results[0])


# Qwen's and Llama 3's attention options (issue 48): the QKV bias is split with the QKV rows,
# the per-head q/k norms are replicated and see only each rank's heads, so their gradients must
# be summed over TP with or without SP (a missing sum leaves them O(lr) apart)
QWEN_LIKE = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--add-qkv-bias",
    "--qk-layernorm", "--use-rope-scaling", "--rope-scaling-factor", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def single_qwen_like(tmp_path_factory) -> dict:
    return layout_run([*EQUIVALENCE, *QWEN_LIKE], 1, str(tmp_path_factory.mktemp("qwen")))[0]


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [
        (2, TP2),
        (2, [*TP2, "--sequence-parallel"]),
        (4, [*TP2, "--sequence-parallel", "--pipeline-model-parallel-size", "2",
             "--parallel", "1f1b"]),
        (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    ],
    ids=["tp2", "tp2-sp", "tp2-sp-pp2", "cp2-p2p"],
)  # fmt: skip
def test_qkv_bias_and_qk_layernorm_match_one_process(
    single_qwen_like, tmp_path: Path, world_size, flags
):
    results = layout_run([*EQUIVALENCE, *QWEN_LIKE, *flags], world_size, str(tmp_path))
    params = single_qwen_like["params"]
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in params
    assert "decoder.layers.0.self_attention.k_layernorm.weight" in params
    assert_same_training(single_qwen_like, results[0])


YARN = [
    "--position-embedding-type", "yarn", "--yarn-rotary-scaling-factor", "4",
    "--yarn-original-max-position-embeddings", "8",
]  # fmt: skip


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [(2, [*TP2, "--sequence-parallel"]), (2, ["--context-parallel-size", "2"])],
    ids=["tp2-sp", "cp2"],
)
def test_yarn_rope_matches_one_process(tmp_path: Path, world_size, flags):
    """YaRN's tables cover the full sequence on every rank (sequence- and context-parallel
    shards rotate by their global positions)."""
    single = layout_run([*EQUIVALENCE, *YARN], 1, str(tmp_path / "one"))[0]
    results = layout_run([*EQUIVALENCE, *YARN, *flags], world_size, str(tmp_path / "many"))
    assert_same_training(single, results[0])
