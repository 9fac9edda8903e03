"""The ``flex`` dispatcher's trips on 2 GPUs, through torch's NVSHMEM all-to-alls: the same
contract as on CPU ranks (tests/flex_exchange_worker.py), and after the first call (which makes
the symmetric buffers) nothing waits for the GPU (``torch.cuda.set_sync_debug_mode("error")``
around the third call's trips and their backward); and the overlapped schedule's two streams
against the in-order one, every stream slowed where a race would show
(tests/flex_overlap_worker.py). Skipped without 2 CUDA GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.parametrize("local", [1, 4])
def test_the_flex_trips_hold_their_contract_over_nvshmem_without_a_host_sync(local: int):
    worker = Path(__file__).with_name("flex_exchange_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(worker)]
    env = {
        **os.environ, "FLEX_DEVICE": "cuda", "FLEX_LOCAL": str(local),
        "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
    }  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("flex trips hold their contract") == 2, result.stdout[-2000:]


@pytest.mark.parametrize("caching", ["cached", "uncached"])
def test_overlapped_flex_equals_in_order_flex_with_every_stream_slowed(caching: str):
    """``--overlap-moe-expert-parallel-comm``'s two chunks on two streams give the in-order
    schedule's outputs and gradients while every trip and every expert call first keeps its
    stream busy (tests/flex_overlap_worker.py): a missing wait reads unfinished rows. Uncached:
    with the caching allocator off, a block reused too early by another stream would differ."""
    worker = Path(__file__).with_name("flex_overlap_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(worker)]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
    if caching == "uncached":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("overlapped flex equals in-order flex") == 2, result.stdout[-2000:]
