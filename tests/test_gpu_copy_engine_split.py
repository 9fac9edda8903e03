"""``MEGA_TP_SPLIT_OVERLAP=copy-engine`` (mega.parallel.tensor.copy_engine_split) against the
NCCL split on 2 (and 4) GPUs: eager, and captured in a CUDA graph and replayed with new inputs
(tests/copy_engine_split_worker.py). The model-level check, graphs on, is
tests/test_gpu_compiled_parallel.py's ``tp2-sp-split-copy``. Skipped without 2 CUDA GPUs."""

from __future__ import annotations

import os
import signal
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
    # its own process group: a hang (a signal never put) is killed whole, workers included,
    # which would otherwise spin on the GPUs until the signals' 600 s timeout
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        stdout, stderr = run.communicate()
        pytest.fail(f"hung: {stdout[-2000:]}{stderr[-2000:]}")
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert stdout.count("splits agree") == gpus, stdout[-2000:]
