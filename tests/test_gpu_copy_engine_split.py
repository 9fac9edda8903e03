"""``MEGA_TP_SPLIT_OVERLAP=copy-engine`` (mega.parallel.tensor.copy_engine_split) against the
NCCL split on 2 (and 4) GPUs: eager, and captured in a CUDA graph and replayed with new inputs
(tests/copy_engine_split_worker.py). The model-level check, graphs on, is
tests/test_gpu_compiled_parallel.py's ``tp2-sp-split-copy``. Skipped without 2 CUDA GPUs."""

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
WORKER = Path(__file__).with_name("copy_engine_split_worker.py")


@pytest.mark.parametrize("gpus", [2, 4])
def test_copy_engine_split_matches_the_nccl_split(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
    command += ["--master-port", str(29870 + gpus), str(WORKER)]
    env = {**os.environ, "MEGA_TP_SPLIT_OVERLAP": "copy-engine"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("splits agree") == gpus, result.stdout[-2000:]
