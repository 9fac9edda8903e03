"""The ``flex`` dispatcher's trips on 2 GPUs, through torch's NVSHMEM all-to-alls: the same
contract as on CPU ranks (tests/flex_exchange_worker.py), and after the first call (which makes
the symmetric buffers) nothing waits for the GPU (``torch.cuda.set_sync_debug_mode("error")``
around the third call's trips and their backward). Skipped without 2 CUDA GPUs."""

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
