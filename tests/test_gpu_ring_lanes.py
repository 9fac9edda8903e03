"""The ring's copy-engine lanes against NCCL send/recv (mega.parallel.context.lanes): ring
attention's output and gradients agree (tests/ring_lanes_worker.py says how closely) on 2 and 4
GPUs, over calls that reuse and grow the inboxes. Skipped without 2 CUDA GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
WORKER = Path(__file__).with_name("ring_lanes_worker.py")


@pytest.mark.parametrize("gpus", [2, 4])
def test_copy_engine_lanes_match_nccl(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
    command += ["--master-port", str(29850 + gpus), str(WORKER)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("copy-engine and nccl agree") == gpus, result.stdout[-2000:]
