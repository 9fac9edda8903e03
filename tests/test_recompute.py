"""Activation recomputation: the same numbers as without it, and fewer saved activations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mega.core.config.resolve import resolve_config
from mega.core.console.display import Display
from mega.core.plugins.manager import make_plugins
from mega.core.training.engine import Engine
from mega.core.training.step import masked_lm_loss

from parallel_runs import EQUIVALENCE, assert_same_training, layout_run

FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block"]
SELECTIVE = ["--recompute-granularity", "selective"]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return layout_run(EQUIVALENCE, 1, str(tmp_path_factory.mktemp("single")))[0]


@pytest.mark.parametrize(
    "flags",
    [[*FULL_UNIFORM, "--recompute-num-layers", "2"], [*FULL_BLOCK, "--recompute-num-layers", "1"], SELECTIVE],
    ids=["full-uniform", "full-block", "selective"],
)  # fmt: skip
def test_recompute_changes_no_number(single, tmp_path: Path, flags):
    result = layout_run([*EQUIVALENCE, *flags], 1, str(tmp_path))[0]
    assert_same_training(single, result, rel=0.0, atol=0.0)  # bit-identical


def saved_activation_bytes(flags: list[str], tmp_path: Path) -> int:
    """Bytes autograd keeps from one forward of a 4-layer GPT (outside checkpointed regions)."""
    plugins = make_plugins()
    args = [*EQUIVALENCE, "--num-layers", "4", *flags, "--run-dir", str(tmp_path)]
    engine = Engine(resolve_config(args, plugins), plugins, Display(enabled=False))
    engine.setup()
    microbatch = engine._microbatches(engine.splits.train, 0)[0]
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = masked_lm_loss(engine.model, microbatch)
    loss.backward()  # and the recomputation runs
    return total


def test_recompute_keeps_fewer_activations(tmp_path: Path):
    none = saved_activation_bytes([], tmp_path)
    selective = saved_activation_bytes(SELECTIVE, tmp_path)
    block = saved_activation_bytes([*FULL_BLOCK, "--recompute-num-layers", "1"], tmp_path)
    uniform = saved_activation_bytes([*FULL_UNIFORM, "--recompute-num-layers", "2"], tmp_path)
    assert selective < none
    # block: 1 of 4 layers recomputed; uniform: 2 groups of 2 layers keep only their inputs
    assert uniform < block < none
    assert uniform < 0.4 * none
