"""The ``flex`` dispatcher's trips on 2 GPUs, through torch's NVSHMEM all-to-alls: the same
contract as on CPU ranks (tests/flex_exchange_worker.py), and after the first call (which makes
the symmetric buffers) nothing waits for the GPU (``torch.cuda.set_sync_debug_mode("error")``
around the third call's trips and their backward); and the overlapped schedule's two streams
against the in-order one, every stream slowed where a race would show
(tests/flex_overlap_worker.py); and the trips alone, in order, many times, each against c10d's
(tests/flex_race_worker.py). Skipped without 2 CUDA GPUs."""

from __future__ import annotations

import pytest
import torch

from conftest import run_workers

# NVLink multicast stays off on the lent machines: NCCL's, NVSHMEM's and symmetric memory's
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
NO_MULTICAST["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.parametrize("transport", ["split", "padded", "copy-engine", "peer-rows"])
@pytest.mark.parametrize("local", [1, 4])
def test_the_flex_trips_hold_their_contract_on_gpus_without_a_host_sync(local: int, transport: str):
    """Over NVSHMEM (``split``), over NCCL's all-to-all of fixed splits (``padded``) and the same
    blocks by the copy engine (``copy-engine``) and their real rows by a kernel (``peer-rows``;
    the worker checks neither is the fallback)."""
    env = {**NO_MULTICAST, "FLEX_DEVICE": "cuda", "FLEX_LOCAL": str(local)}
    env["MEGA_FLEX_TRANSPORT"] = transport
    stdout = run_workers("flex_exchange_worker.py", 2, env)
    assert stdout.count("flex trips hold their contract") == 2, stdout[-2000:]


# Over NVSHMEM it failed on 2 H200 on 2026-11-30 (3332b02), both cases, on one rank or the
# other: why is not yet known (tests/flex_race_worker.py probes torch's kernel). GPU runs refuse
# the overlap meanwhile (mega.parallel.expert.validate.OVERLAP_ON_GPUS); not strict, since a race
# may pass a run. Over the padded transport (no NVSHMEM kernel) it passed, both cases (2 H200,
# 2026-11-30, 14a6f8e): the schedule's waits hold and NVSHMEM's kernel, under overlap, is the
# suspect. In order, 600 NVSHMEM trips (race probe, three modes) were all right.
_NVSHMEM_RACED = pytest.mark.xfail(reason="raced over NVSHMEM on 2 H200 (2026-11-30)", strict=False)


@pytest.mark.parametrize(
    "transport", [pytest.param("split", marks=_NVSHMEM_RACED), pytest.param("padded")]
)
@pytest.mark.parametrize("caching", ["cached", "uncached"])
def test_overlapped_flex_equals_in_order_flex_with_every_stream_slowed(
    caching: str, transport: str
):
    """``--overlap-moe-expert-parallel-comm``'s two chunks on two streams give the in-order
    schedule's outputs and gradients while every trip and every expert call first keeps its
    stream busy (tests/flex_overlap_worker.py): a missing wait reads unfinished rows. Uncached:
    with the caching allocator off, a block reused too early by another stream would differ."""
    env = {**NO_MULTICAST, "MEGA_FLEX_TRANSPORT": transport}
    if caching == "uncached":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    stdout = run_workers("flex_overlap_worker.py", 2, env)
    assert stdout.count("overlapped flex equals in-order flex") == 2, stdout[-2000:]


def test_every_flex_trip_reads_its_blocks_from_their_places_idle_busy_and_empty_first():
    """torch's 2D kernel lets thread block 0 overwrite the source offsets the other blocks read
    when they start (a write-after-read race named in torch's PR 192300): 200 small trips per
    mode, each against the same trip by c10d, none may differ (tests/flex_race_worker.py). The
    overlapped schedule's race test failed on 2 H200 on 2026-11-30; this says whether in-order
    flex carries the same risk."""
    env = dict(NO_MULTICAST)
    stdout = run_workers("flex_race_worker.py", 2, env)
    for mode in ("idle", "busy", "empty-first"):
        assert f"race probe {mode}: 200 trips on 2 ranks, 0 wrong" in stdout, stdout


@pytest.mark.parametrize("transport", ["split", "padded", "copy-engine", "peer-rows"])
def test_the_compiled_flex_layer_matches_eager_and_one_gpu_with_the_grouped_gemm(transport: str):
    """The flex dispatcher with the grouped GEMM in bf16, compiled by Inductor, against itself
    eager and against every expert on one GPU, over four routings (tests/
    moe_dispatch_compile_worker.py with ``MOE_GPU=1``). Where the padded transport's training
    gradients were off one GPU's (2 H200, 2026-11-30), this says whether the layer alone is."""
    env = {
        "MOE_GPU": "1", "MOE_DISPATCHER": "flex" if transport == "split" else "flex-padded",
        "MEGA_FLEX_TRANSPORT": transport, **NO_MULTICAST,
    }  # fmt: skip
    stdout = run_workers("moe_dispatch_compile_worker.py", 2, env)
    assert stdout.count("matches eager and one process") == 2, stdout[-2000:]
    if transport in ("copy-engine", "peer-rows"):
        assert stdout.count("symmetric memory carried the compiled layer's trips") == 2, stdout


def test_the_pipelined_flex_layer_is_one_graph_and_matches_eager_and_one_gpu():
    """``--overlap-moe-expert-parallel-comm`` over the padded trips (the GPU default): two
    chunks, each trip begun early and ended late on one stream (``flex_schedule.pipelined``),
    compiled by Inductor with the grouped GEMM in bf16: one graph, no recompile over four
    routings, and eager's and one GPU's outputs and gradients."""
    env = {
        "MOE_GPU": "1", "MOE_DISPATCHER": "flex-overlap", "MEGA_FLEX_TRANSPORT": "padded",
        **NO_MULTICAST,
    }  # fmt: skip
    stdout = run_workers("moe_dispatch_compile_worker.py", 2, env)
    assert stdout.count("matches eager and one process") == 2, stdout[-2000:]
    assert stdout.count("the pipelined dispatch is one graph") == 2, stdout[-2000:]
