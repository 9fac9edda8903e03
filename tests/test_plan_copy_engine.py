"""``mega plan`` with ``MEGA_TP_SPLIT_OVERLAP=copy-engine`` (mega.core.plan.copy_engine): each
split pass's transfer counted beside the own token block's GEMM, and only what outlasts that GEMM
in the step. The recorded 2-H200 row is tests/test_plan_cuda_graphs_h200.py's
``copy_engine_graphs_only`` case (planned 17% slow when the split was counted as NCCL's)."""

from __future__ import annotations

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import beside_seconds, plan_run
from mega.core.plan.tracking import Work
from mega.core.plugins.manager import make_plugins

LAYERS = 2
ARGV = [
    "--model", "gpt", "--num-layers", str(LAYERS), "--hidden-size", "256",
    "--num-attention-heads", "4", "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--nproc-per-node", "2", "--bf16", "--device", "cuda",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    # as the recorded row ran: graphed, so this small model's step is its GPU's (graph-free,
    # the host's launches of its many small kernels would set it)
    "--cuda-graph-impl", "local",
]  # fmt: skip


def _plan(monkeypatch: pytest.MonkeyPatch, split: str):
    monkeypatch.setenv("MEGA_TP_SPLIT_OVERLAP", split)
    plugins = make_plugins()
    return plan_run(resolve_config(ARGV, plugins, this_machine=False), plugins, BUILT_IN["h200"])


def test_only_the_transfer_beyond_its_gemm_shows():
    rates = BUILT_IN["h200"]
    sent = 16 * 2**20
    transfer = rates.copy_engine_seconds(sent)
    short_gemm, long_gemm = 0.25 * transfer * rates.matmul_flops, 2 * transfer * rates.matmul_flops
    work = Work()
    work.beside[sent, 1, short_gemm] += 3
    work.beside[sent, 1, long_gemm] += 5
    assert beside_seconds(work, rates) == pytest.approx(3 * 0.75 * transfer)
    assert beside_seconds(work, rates.without_communication()) == 0.0
    # three peers: three copies' fixed costs, one after another
    three = Work()
    three.beside[sent, 3, 0.0] += 1
    assert beside_seconds(three, rates) == pytest.approx(
        transfer + 2 * rates.copy_engine_latency_seconds
    )


def test_the_split_passes_are_counted_beside_their_gemms(monkeypatch):
    nccl, copy = _plan(monkeypatch, "1"), _plan(monkeypatch, "copy-engine")
    forward, backward = copy.stages[0].profile.forward, copy.stages[0].profile.backward
    # per layer: two column- and two row-parallel forward passes; in backward each row-parallel
    # layer's gather of dY and each column-parallel layer's gather of X and reduce of dX
    assert sum(forward.beside.values()) == 4 * LAYERS
    assert sum(backward.beside.values()) == (2 + 2 * 2) * LAYERS
    # per layer, NCCL's six [b, s, h] collectives in backward leave the count (the embedding's
    # and the output head's stay)
    full = 2 * 256 * 256 * 2  # micro-batch x sequence x hidden, bf16

    def tp_bytes(work: Work) -> float:
        return sum(v for (dim, *_), v in work.collectives.items() if dim == "tp")

    nccl_backward = tp_bytes(nccl.stages[0].profile.backward)
    assert nccl_backward - tp_bytes(backward) == 6 * LAYERS * full
    assert not nccl.stages[0].profile.forward.beside
    # the split's gathers and reduce-scatters leave NCCL's count: the forward's tp collectives
    # are the embedding's and the loss's alone
    nccl_bytes = sum(
        v for (dim, *_), v in nccl.stages[0].profile.forward.collectives.items() if dim == "tp"
    )
    copy_bytes = sum(v for (dim, *_), v in forward.collectives.items() if dim == "tp")
    assert copy_bytes < nccl_bytes
    assert copy.step_seconds < nccl.step_seconds
