"""MoE layouts on 2 GPUs (NCCL, bf16) against the one-GPU run: losses and gradient norms.

Why gradient norms too: on 2 H200 (2026-11-24, ``benchmarks/results/moe_scale_run_2gpu_*``) a
2.7B MoE saved at EP=2 and loaded at TP=2 with SP had the same loss at the first step after the
load (3.5e-5 apart) but a gradient norm 1.40x the EP run's at the same weights and batch, while
dense layouts agree to 1e-3 there, every one-GPU MoE path (loop or grouped GEMM, eager or
compiled) agrees to 3e-4 and the same sequences on CPU ranks (gloo) agree to 1e-7. A loss alone
hides this for a few steps (the first step's loss does not see the gradient), so each layout's
first gradient norm is compared too, and the clip is in play at every step.
First run on 2 H200 (2026-11-24): TP=2+SP and DP=2 passed; EP=2 (both dispatchers), compiled,
had a first gradient norm 18% below one GPU's (1.174 against 1.432) while eager EP=2 matched it
exactly, so ``--compile`` is now refused with EP > 1 and the EP layouts here run eager.
Skipped without 2 CUDA GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_mega

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

MODEL = [
    "--model", "moe", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
    "--num-query-groups", "4", "--num-experts", "8", "--moe-ffn-hidden-size", "1024",
    "--moe-grouped-gemm", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8191", "--bf16",
    "--lr", "1e-4", "--train-iters", "10", "--log-interval", "1", "--eval-iters", "0",
    "--global-batch-size", "8", "--micro-batch-size", "2", "--use-distributed-optimizer",
    "--clip-grad", "0.1",  # clipping acts at every step: a wrong norm changes the updates
]  # fmt: skip
# The loss bound is tests/test_gpu_parallel.py's (bf16 rounding of other layouts' sums). The
# gradient norm is compared at the first step only (the same weights and batch): there dense
# layouts agreed with one GPU to 5e-4 on 2 H200 and every one-GPU MoE path to 3e-4 on an H100; later
# steps drift apart in bf16 (up to 7% at a spiky step of the dense 1.3B GPT), the loss bound covers
# those. 1e-2 is 20x the agreement seen and far below the 40% seen after the MoE reshard.
LOSS_BOUND, FIRST_GRAD_NORM_BOUND = 1e-2, 1e-2


def curves(tmp_path: Path, name: str, flags: list[str]) -> tuple[list[float], list[float]]:
    run_dir = tmp_path / name
    result = run_mega(["train", *MODEL, *flags, "--run-dir", str(run_dir)], tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "lm_loss" in r]
    return [r["lm_loss"] for r in rows], [r["grad_norm"] for r in rows]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], list[float]]:
    losses, norms = curves(tmp_path_factory.mktemp("one"), "one", [])
    assert min(norms) > 0.1  # the clip acts (see MODEL)
    return losses, norms


@pytest.mark.parametrize(
    "name, flags",
    [
        ("ep2-alltoall", ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
        ("ep2-allgather", ["--expert-model-parallel-size", "2"]),
        ("ep2-flex", ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]),
        ("tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("dp2", []),
    ],
)  # fmt: skip
def test_moe_layouts_match_one_gpu(
    tmp_path: Path, name: str, flags: list[str], one_gpu: tuple[list[float], list[float]]
):
    _matches_one_gpu(tmp_path, name, flags, one_gpu)


# ep2-flex above runs the padded all-to-alls (the GPU default). On 2 H200 (2026-11-30) their
# first gradient norm was once 1.17 against one GPU's 1.43: torch 2.11's compile lost the
# gradient of their gather (an in-place fill in an autograd.Function's forward;
# tests/test_moe_flex.py shows it on CPU under 2.11); fixed, and it passed here at 5e5c460.
def test_flex_overlapped_matches_one_gpu(
    tmp_path: Path, one_gpu: tuple[list[float], list[float]], monkeypatch: pytest.MonkeyPatch
):
    """The overlapped trips over the padded all-to-alls (GPUs refuse them, slower than in order;
    ``MEGA_FLEX_OVERLAP_ON_GPUS=1`` runs them). Passed on 2 H200 at a4ab9b5 with the side-stream
    schedule and at c1c71fd with the pipelined one (the grouped GEMM of MODEL picks it)."""
    monkeypatch.setenv("MEGA_FLEX_OVERLAP_ON_GPUS", "1")
    flags = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]
    flags += ["--overlap-moe-expert-parallel-comm"]
    _matches_one_gpu(tmp_path, "ep2-flex-overlap", flags, one_gpu)


def test_flex_by_nvshmem_matches_one_gpu(
    tmp_path: Path, one_gpu: tuple[list[float], list[float]], monkeypatch: pytest.MonkeyPatch
):
    """``MEGA_FLEX_TRANSPORT=split``: flex's trips by torch's NVSHMEM all-to-alls."""
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "split")
    flags = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]
    _matches_one_gpu(tmp_path, "ep2-flex-split", flags, one_gpu)


def test_flex_by_the_copy_engine_matches_one_gpu(
    tmp_path: Path, one_gpu: tuple[list[float], list[float]], monkeypatch: pytest.MonkeyPatch
):
    """``MEGA_FLEX_TRANSPORT=copy-engine``: the padded trips' blocks copied into the peer's
    symmetric memory (tests/test_gpu_moe_flex.py checks the copy engine, not the fallback, ran)."""
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "copy-engine")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the machines' rule
    flags = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]
    _matches_one_gpu(tmp_path, "ep2-flex-copy-engine", flags, one_gpu)


def test_flex_by_peer_rows_matches_one_gpu(
    tmp_path: Path, one_gpu: tuple[list[float], list[float]], monkeypatch: pytest.MonkeyPatch
):
    """``MEGA_FLEX_TRANSPORT=peer-rows``: only the padded blocks' real rows written into the
    peer's symmetric memory by a kernel (tests/test_gpu_moe_flex.py checks the kernel, not the
    fallback, ran)."""
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "peer-rows")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the machines' rule
    flags = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]
    _matches_one_gpu(tmp_path, "ep2-flex-peer-rows", flags, one_gpu)


def _matches_one_gpu(
    tmp_path: Path, name: str, flags: list[str], one_gpu: tuple[list[float], list[float]]
) -> None:
    losses, norms = one_gpu
    got_losses, got_norms = curves(tmp_path, name, [*flags, "--nproc-per-node", "2"])
    first_norm = abs(got_norms[0] - norms[0]) / norms[0]
    report = {"loss": max_rel(got_losses, losses), "first_grad_norm": first_norm}
    print(name, json.dumps(report), got_norms, norms)
    assert report["loss"] <= LOSS_BOUND, (name, report)
    assert first_norm <= FIRST_GRAD_NORM_BOUND, (name, report, got_norms, norms)
