"""Wrappers for parameter-free modules: run under the TP RNG, or enter the sequence-parallel region.

Wrapping adds a ``.module`` level to the wrapped module's path; only parameter-free modules
(dropouts, core attention) are wrapped, so no parameter name ever changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mega.parallel.tensor.mappings import gather_sequence_replicated, scatter_to_sequence
from mega.parallel.tensor.rng import TensorParallelRNG


def _check_parameter_free(module: nn.Module) -> None:
    if any(True for _ in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has parameters: wrapping it would rename them "
            "(only parameter-free modules may run under the tensor-parallel RNG)"
        )


def draws_random(module: nn.Module) -> bool:
    """Whether ``module``'s forward may draw random numbers now. A dropout (``nn.Dropout``'s
    ``p``, or a module's ``dropout_p``, as the core attention's) draws only in training with a
    probability above 0; a module that is neither may draw anything, so it counts as drawing."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.training and module.p > 0
    if isinstance(getattr(module, "dropout_p", None), float | int):
        return module.training and module.dropout_p > 0
    return True


class RunUnderRNG(nn.Module):
    """``module``'s forward under ``tracker.fork()``: its dropout differs on each TP rank.

    The fork swaps generator states (``torch.get_rng_state``), which torch.compile does not
    trace: every fork inside a compiled layer breaks its graph there, and dynamo ran some
    frames wholly eager ("Failed to handle graph break gracefully", TORCH_LOGS=graph_breaks,
    compiled TP2 + SP on CPU ranks). Under sequence parallelism every dropout of a layer is
    wrapped. A module that draws nothing now (dropout 0, or evaluation) runs without the fork:
    the stream would not have moved, so the numbers are the same, and the layer is one graph."""

    def __init__(self, module: nn.Module, tracker: TensorParallelRNG) -> None:
        super().__init__()
        _check_parameter_free(module)
        self.module = module
        self.tracker = tracker

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not draws_random(self.module):
            return self.module(*args, **kwargs)
        with self.tracker.fork():
            return self.module(*args, **kwargs)


class ScatterToSequence(nn.Module):
    """Sequence parallelism's entry: keep this rank's ``[b, s/tp, h]`` block of the replicated
    ``[b, s, h]`` input, then run the wrapped elementwise module (the embedding dropout) on it
    under the TP RNG, as Megatron does: each rank drops its own tokens with its own stream."""

    def __init__(self, module: nn.Module, group: Any, tracker: TensorParallelRNG) -> None:
        super().__init__()
        _check_parameter_free(module)
        self.module = module
        self.group = group
        self.tracker = tracker

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = scatter_to_sequence(hidden, self.group)
        if not draws_random(self.module):  # see RunUnderRNG
            return self.module(hidden)
        with self.tracker.fork():
            return self.module(hidden)


class GatherFromSequence(nn.Module):
    """Sequence parallelism's exit into replicated code: gather the ``[b, s/tp, h]`` input to
    ``[b, s, h]``, then run the wrapped module. Every rank computes the same thing from there
    (BERT's pooler), so the backward keeps this rank's block of the gradient (Megatron's
    ``tensor_parallel_output_grad=False``) instead of summing over the ranks."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        super().__init__()
        _check_parameter_free(module)
        self.module = module
        self.group = group

    def forward(self, hidden: torch.Tensor) -> Any:
        return self.module(gather_sequence_replicated(hidden, self.group))
