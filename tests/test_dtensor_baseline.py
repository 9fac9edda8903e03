"""``benchmarks/dtensor_tp.py`` (PyTorch's own DTensor TP, the baseline against mega's TP) runs
end to end on the CPU over gloo at toy size, so that a broken script is found here rather than on
leased GPUs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from mega.testing import free_port

from conftest import LAUNCHER_VARS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "dtensor_tp.py"


def test_dtensor_tp_smoke_run_on_the_cpu(tmp_path: Path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(SCRIPT),
        "--device", "cpu", "--tp", "2", "--sp", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--seq", "32", "--vocab", "256", "--mbs", "2", "--gbs", "4", "--iters", "3",
        "--warmup", "1", "--out", str(tmp_path), "--name", "smoke",
    ]  # fmt: skip
    # a test inside a launched job still forms its own group
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("smoke_*.json")
    report = json.loads(result.read_text())
    assert report["flags"]["tp"] == 2 and report["flags"]["sp"] is True
    assert report["flags"]["compile"] is False
    row = report["results"]
    assert (row["tp"], row["dp"], row["sp"], row["world_size"]) == (2, 1, True, 2)
    assert len(row["losses"]) == 4 and all(math.isfinite(x) for x in row["losses"])
    # random next tokens over 256 ids at init: near ln(256) = 5.55
    assert abs(row["losses"][0] - math.log(256)) < 0.5
    assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
    # the one summary line on stdout is the file's numbers
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["losses"] == row["losses"]


def test_dtensor_tp_counts_flops_as_mega_does():
    """The script's FLOPs per token (replicated so that it runs without mega installed) is
    mega's ``flops_per_token`` for the benchmark model."""
    from mega.plugins.models.common.config import GPTConfig
    from mega.plugins.models.common.flops import flops_per_token

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import dtensor_tp
    finally:
        sys.path.pop(0)
    for layers, hidden, heads, seq, vocab in ((24, 2048, 16, 2048, 50176), (2, 64, 4, 32, 256)):
        cfg = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads)
        expected = flops_per_token(cfg, seq, vocab)
        assert dtensor_tp.flops_per_token(layers, hidden, heads, seq, vocab) == expected
