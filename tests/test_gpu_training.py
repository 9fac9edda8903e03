"""The single-process engine on one CUDA GPU (skipped where there is none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mega.core.console import Display
from mega.core.engine import Engine
from mega.core.plugins import make_plugins
from mega.core.resolve import resolve_config

from conftest import TINY

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "4096"]])
def test_trains_on_cuda(tmp_path: Path, precision: list[str]):
    plugins = make_plugins()
    args = [
        *TINY,
        "--device",
        "cuda",
        "--train-iters",
        "30",
        "--run-dir",
        str(tmp_path),
        *precision,
    ]
    engine = Engine(resolve_config(args, plugins), plugins, Display(rich_output=False))
    engine.train()
    assert next(engine.model.parameters()).is_cuda
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert losses[-1] < losses[0] - 0.5
    assert all(m.dtype == torch.float32 for m in engine.optimizer.masters)
