"""Activation recomputation (``--recompute-granularity``), applied to a built model from outside.

- ``selective``: the core attention (softmax(QK^T)V, its dropout) of every layer is recomputed in
  backward; its large ``[b, heads, s, s]`` intermediates are never kept (Megatron's default
  ``core_attn`` module).
- ``full`` with ``--recompute-method uniform``: the layers are cut into groups of
  ``--recompute-num-layers``; only each group's input is kept and the group is recomputed.
- ``full`` with ``--recompute-method block``: the first ``--recompute-num-layers`` layers are
  recomputed one by one; the rest keep their activations.

Recomputation replays the forward with the random state it first saw: torch's checkpoint restores
the default CPU/CUDA generators, and the tensor-parallel RNG tracker (``model.tensor_parallel_rng``,
when there is one) is restored here, so recomputed dropout masks are bit-identical.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mega.parallel.plan import layer_lists


def _tracker_contexts(tracker: Any) -> Callable[[], tuple[Any, Any]]:
    """checkpoint's ``context_fn``: the recompute runs with the tracker state of the forward."""

    def context_fn() -> tuple[Any, Any]:
        saved = tracker.get_state()

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            current = tracker.get_state()
            tracker.set_state(saved)
            try:
                yield
            finally:
                tracker.set_state(current)

        return contextlib.nullcontext(), replay()

    return context_fn


def _checkpointed(forward: Callable[..., Any], tracker: Any) -> Callable[..., Any]:
    # Without a tracker, checkpoint's own context: torch.compile accepts no other (it traces
    # checkpoint as a graph region, and the recompute's dropout masks are its business then).
    # There is a tracker only under tensor parallelism; compiled, full recompute keeps its
    # checkpoint outside the compiled layer (checkpoint_outside), where the context is eager.
    extra = {} if tracker is None else {"context_fn": _tracker_contexts(tracker)}

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    run.checkpointed = forward  # what checkpoint_outside wraps
    run.tracker = tracker
    return run


def checkpoint_outside(module: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> bool:
    """If ``module``'s forward is a checkpoint made here, put ``wrap`` (``torch.compile``) around
    what it checkpoints and keep the checkpoint outside, eager; False if it is not one.

    Compiled around the checkpoint, the checkpoint is traced into the graph and the partitioner
    still saves tensors inside it: a 1.3B GPT layer (torch 2.11, one H100) kept its QKV and FC1
    outputs, 288 MiB per layer at micro-batch 4, and full recompute of the compiled model took
    29.9 GiB where --no-compile took 27.5. An eager checkpoint around the compiled forward
    drops everything the compiled graph saves and replays the compiled forward in backward."""
    run = module.__dict__.get("forward")  # an instance attribute, as apply_recompute sets it
    inner = getattr(run, "checkpointed", None)
    if inner is None:
        return False
    module.forward = _checkpointed(wrap(inner), run.tracker)
    return True


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether apply_recompute made ``module``'s forward a checkpoint."""
    return hasattr(module.__dict__.get("forward"), "checkpointed")


def _passthrough(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return hidden


def _group_forward(layers: list[torch.nn.Module]) -> Callable[..., Any]:
    """One forward for consecutive layers (each called with the same extra arguments)."""
    forwards = [layer.forward for layer in layers]

    def run(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        for forward in forwards:
            hidden = forward(hidden, *args, **kwargs)
        return hidden

    return run


def apply_recompute(
    model: torch.nn.Module,
    plan: Any,
    granularity: str | None,
    method: str | None = None,
    num_layers: int | None = None,
) -> int:
    """Wrap the plan's modules' forwards in activation checkpoints; returns how many were wrapped.

    Parameter names do not change: forwards are replaced on the module instances.
    """
    if granularity is None:
        return 0
    tracker = getattr(model, "tensor_parallel_rng", None)
    if granularity == "selective":
        if not plan.core_attention:
            raise ValueError("the model's parallel plan names no core attention module")
        targets = [
            module
            for name, module in model.named_modules()
            if fnmatch.fnmatchcase(name, plan.core_attention)
        ]
        for module in targets:
            module.forward = _checkpointed(module.forward, tracker)
        return len(targets)
    return sum(
        _recompute_layers(list(model.get_submodule(path)), method, num_layers or 1, tracker)
        for path in layer_lists(plan)
    )


def _recompute_layers(
    layers: list[torch.nn.Module], method: str | None, count: int, tracker: Any
) -> int:
    """Full recompute of one layer list (a model may have two: T5's encoder and decoder)."""
    if method == "block":
        for layer in layers[:count]:
            layer.forward = _checkpointed(layer.forward, tracker)
        return min(count, len(layers))
    # uniform: the first layer of each group runs the whole group under one checkpoint and the
    # others pass its output through, so only one activation per group is kept
    for start in range(0, len(layers), count):
        group = layers[start : start + count]
        group[0].forward = _checkpointed(_group_forward(group), tracker)
        for layer in group[1:]:
            layer.forward = _passthrough
    return -(-len(layers) // count)
