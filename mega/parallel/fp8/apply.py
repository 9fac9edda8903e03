"""Which weights run in FP8: the column- and row-parallel linears of the plan's transformer layers
(QKV, proj, FC1, FC2 for the GPT), as in Megatron, where Transformer Engine's layers are exactly
those. The embedding, the output layer, norms, the MoE router and experts stay in bf16.
``--first-last-layers-bf16`` keeps the first and last few layers of each layer list in bf16 too.

A weight is marked by an ``fp8_format`` attribute, which ``mega.parallel.linear.linear`` reads on
every call; the module must therefore call it (``mega.parallel.linear.Linear`` or a tensor-parallel
linear), which is checked here rather than left to silently run in bf16.
"""

from __future__ import annotations

import re

from torch import nn

from mega.errors import MegaUsageError
from mega.parallel.fp8.checks import ALIGNMENT
from mega.parallel.fp8.weight_cast import load_kernels
from mega.parallel.linear import Linear
from mega.parallel.plan import COLUMN, ROW, ParallelPlan, layer_lists
from mega.parallel.tensor.apply import matching_paths
from mega.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear

FP8_CAPABLE = (Linear, ColumnParallelLinear, RowParallelLinear)


def apply_fp8(
    model: nn.Module,
    plan: ParallelPlan,
    fp8_format: str,
    bf16_at_start: int = 0,
    bf16_at_end: int = 0,
) -> list[str]:
    """Mark the FP8 weights of this rank's ``model`` (global layer indices, any pipeline stage);
    returns the marked module paths. Layers ``< bf16_at_start`` or ``>= total - bf16_at_end`` of
    each layer list stay in bf16."""
    load_kernels()  # the fused casts' Triton kernels, where there is Triton
    marked = []
    for layers_path in layer_lists(plan):
        total = _layer_count(model, plan, layers_path)
        index = re.compile(re.escape(layers_path) + r"\.(\d+)\.")
        for pattern, style in plan.tensor.items():
            if style not in (COLUMN, ROW) or not pattern.startswith(f"{layers_path}.*."):
                continue
            for path in matching_paths(model, pattern):
                i = int(index.match(path).group(1))
                if i < bf16_at_start or i >= total - bf16_at_end:
                    continue
                _mark(model.get_submodule(path), path, fp8_format)
                marked.append(path)
    return marked


def _layer_count(model: nn.Module, plan: ParallelPlan, layers_path: str) -> int:
    """Layers in the whole list: a pipeline stage holds some of ``plan.layers`` only."""
    if layers_path == plan.layers and plan.num_layers:
        return plan.num_layers
    return len(model.get_submodule(layers_path))


def _mark(module: nn.Module, path: str, fp8_format: str) -> None:
    if not isinstance(module, FP8_CAPABLE):
        raise MegaUsageError(
            f"--fp8-format: '{path}' is a {type(module).__name__}, whose forward does not call"
            " mega.parallel.linear.linear (use mega.parallel.linear.Linear for FP8)"
        )
    shape = tuple(module.weight.shape)
    if any(size % ALIGNMENT for size in shape):
        raise MegaUsageError(
            f"--fp8-format: the weight of '{path}' is {shape} on this rank; FP8 GEMMs need both"
            f" sizes divisible by {ALIGNMENT}"
        )
    module.weight.fp8_format = fp8_format
