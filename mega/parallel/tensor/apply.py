"""Rewrite a single-device model for tensor (and sequence) parallelism, from its ParallelPlan.

Call it on the initialised, full, float32 model (on the CPU), after any pipeline split and
before the model moves to its device and dtype: each rank cuts its shard out of the global
parameters it already holds, so the sharded model is the full model's init for any TP size.

What each plan style becomes (module paths may contain ``*`` for one path component):

| style              | module before     | after                                                 |
|--------------------|-------------------|-------------------------------------------------------|
| COLUMN             | ``nn.Linear``     | ``ColumnParallelLinear`` (``stacked`` blocks split one by one) |
| ROW                | ``nn.Linear``     | ``RowParallelLinear``                                 |
| VOCAB_EMBEDDING    | ``nn.Embedding``  | ``VocabParallelEmbedding``                            |
| LM_HEAD            | parameter-free head | ``VocabParallelOutputHead``                         |
| SEQUENCE_SCATTER   | elementwise, parameter-free (a dropout) | under SP: ``ScatterToSequence`` |
| SEQUENCE_GATHER    | parameter-free    | under SP: ``GatherFromSequence`` (input gathered) |
| VOCAB_BIAS         | module with ``bias [V]`` only | the same module, ``bias [V/tp]``          |
| HEAD_COLUMNS       | ``nn.Embedding [n, heads]`` | the same module, ``weight [n, heads/tp]``   |

The parameters of ``tensor_parallel_partial_grads`` modules stay replicated and are marked
``param.sequence_parallel = True`` at any SP setting (each rank's gradient covers its own heads
only). Then ``tensor_parallel_rng`` modules run under the TP RNG; under SP, dropouts inside
``sequence_parallel_region`` do too, that region's replicated parameters get
``param.sequence_parallel = True`` (their gradients are partial sums over TP: the gradient code
all-reduces them over the TP group) and its ``sequence_shards`` attributes are set to the TP size.
A pattern that matches nothing is skipped: a pipeline stage may lack the embedding or the head.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from mega.parallel.plan import (
    COLUMN,
    HEAD_COLUMNS,
    LM_HEAD,
    ROW,
    SEQUENCE_GATHER,
    SEQUENCE_SCATTER,
    VOCAB_BIAS,
    VOCAB_EMBEDDING,
    ParallelPlan,
)
from mega.parallel.shard import ShardSpec
from mega.parallel.tensor.embedding import VocabParallelEmbedding
from mega.parallel.tensor.head import VocabParallelOutputHead
from mega.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear, shard_parameter
from mega.parallel.tensor.regions import GatherFromSequence, RunUnderRNG, ScatterToSequence
from mega.parallel.tensor.rng import TensorParallelRNG
from mega.parallel.topology import Topology


def matching_paths(model: nn.Module, pattern: str) -> list[str]:
    """Module paths of ``model`` matching ``pattern``, where ``*`` stands for one path component."""
    regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
    return [name for name, _ in model.named_modules() if name and regex.match(name)]


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    new.train(model.get_submodule(path).training)
    setattr(parent, child, new)


def _expect(module: nn.Module, cls: type, path: str, style: str) -> None:
    # the parallel replacements are not subclasses of these, so a module is never split twice
    if not isinstance(module, cls):
        raise TypeError(
            f"plan marks '{path}' {style}, which needs {cls.__name__}, got {type(module).__name__}"
        )


def apply_tensor_parallel(
    model: nn.Module,
    plan: ParallelPlan,
    topology: Topology,
    sequence_parallel: bool,
    *,
    seed: int | None = None,
    comm_overlap: bool = False,
) -> None:
    """Shard ``model`` in place over ``topology``'s TP group; parameter names do not change.
    ``comm_overlap`` (``--tp-comm-overlap``): column-parallel layers hide their backward
    collective behind the weight-gradient GEMM (``mega.parallel.tensor.overlapped``).

    ``seed`` (default ``model.seed``) seeds the TP RNG stream, ``seed + 2718 + tp_rank``; the
    tracker is stored as ``model.tensor_parallel_rng``. A TP size of 1 changes nothing (as in
    Megatron, sequence parallelism needs TP > 1) and stores no tracker.
    """
    size = topology.tensor_model_parallel_size
    if size == 1:
        return
    problems = plan.problems(size)
    if problems:
        raise ValueError(
            "cannot split the model over tensor-parallel ranks: " + "; ".join(problems)
        )
    if seed is None:
        seed = getattr(model, "seed", None)
        if seed is None:
            raise ValueError("apply_tensor_parallel needs seed= (the model has no .seed)")
    group, rank = topology.group("tp"), topology.tp_rank
    tracker = TensorParallelRNG(seed, rank)

    for pattern, style in plan.tensor.items():
        for path in matching_paths(model, pattern):
            module = model.get_submodule(path)
            new = _parallel_module(
                module, path, style, group, rank, size, sequence_parallel, tracker,
                stacked=plan.stacked.get(pattern, 1), comm_overlap=comm_overlap,
            )  # fmt: skip
            if new is not None:
                _replace(model, path, new)

    for pattern in plan.tensor_parallel_partial_grads:
        for path in matching_paths(model, pattern):
            for param in model.get_submodule(path).parameters():
                param.sequence_parallel = True  # the gradient code sums these over TP

    for pattern in plan.tensor_parallel_rng:
        for path in matching_paths(model, pattern):
            _replace(model, path, RunUnderRNG(model.get_submodule(path), tracker))

    if sequence_parallel:
        for pattern in plan.sequence_parallel_region:
            for path in matching_paths(model, pattern):
                _enter_sequence_parallel(model, path, size, tracker)

    model.tensor_parallel_rng = tracker


def _parallel_module(
    module: nn.Module,
    path: str,
    style: str,
    group: Any,
    rank: int,
    size: int,
    sequence_parallel: bool,
    tracker: TensorParallelRNG,
    *,
    stacked: int,
    comm_overlap: bool = False,
) -> nn.Module | None:
    """The replacement for ``module`` under ``style`` (None: keep it)."""
    if style == COLUMN:
        _expect(module, nn.Linear, path, style)
        return ColumnParallelLinear.from_linear(
            module, group, rank, size, stacked=stacked, sequence_parallel=sequence_parallel,
            comm_overlap=comm_overlap,
        )  # fmt: skip
    if style == ROW:
        _expect(module, nn.Linear, path, style)
        return RowParallelLinear.from_linear(
            module, group, rank, size, sequence_parallel=sequence_parallel
        )
    if style == VOCAB_EMBEDDING:
        _expect(module, nn.Embedding, path, style)
        return VocabParallelEmbedding.from_embedding(module, group, rank, size)
    if style == LM_HEAD:
        if any(True for _ in module.parameters()):
            raise TypeError(f"plan marks '{path}' {style}: the head must be parameter-free")
        return VocabParallelOutputHead(group, sequence_parallel, module.vocab_size)
    if style == SEQUENCE_SCATTER:
        return ScatterToSequence(module, group, tracker) if sequence_parallel else None
    if style == SEQUENCE_GATHER:
        return GatherFromSequence(module, group) if sequence_parallel else None
    if style == VOCAB_BIAS:
        names = [name for name, _ in module.named_parameters()]
        if names != ["bias"]:
            raise TypeError(f"plan marks '{path}' {style}: it must hold one parameter, bias")
        rows = module.bias.shape[0]
        if rows % size:
            raise ValueError(
                f"the padded vocabulary ({rows}) must be divisible by "
                f"--tensor-model-parallel-size ({size})"
            )
        module.bias = shard_parameter(module.bias, ShardSpec((rows,), 0, 1, rank, size))
        return None
    if style == HEAD_COLUMNS:
        _expect(module, nn.Embedding, path, style)
        shape = tuple(module.weight.shape)  # heads divide by tp: the plan's problems say so
        module.weight = shard_parameter(module.weight, ShardSpec(shape, 1, 1, rank, size))
        return None
    raise ValueError(f"plan marks '{path}' with unknown tensor-parallel style {style!r}")


def _enter_sequence_parallel(
    model: nn.Module, region: str, size: int, tracker: TensorParallelRNG
) -> None:
    """Mark, fork and resize what lives in one sequence-sharded region (see module docstring)."""
    root = model.get_submodule(region)
    for param in root.parameters():
        if not hasattr(param, "shard"):
            param.sequence_parallel = True
    # Dropouts act on this rank's block of the tokens: each rank draws its own mask. (A dropout already
    # wrapped, e.g. inside the core attention, forks once: the tracker is re-entrant.)
    dropouts = [
        name
        for name, module in root.named_modules()
        if isinstance(module, nn.Dropout) and not isinstance(_parent(root, name), RunUnderRNG)
    ]
    for name in dropouts:
        _replace(model, f"{region}.{name}", RunUnderRNG(root.get_submodule(name), tracker))
    for module in root.modules():
        if isinstance(getattr(module, "sequence_shards", None), int):
            module.sequence_shards = size


def _parent(root: nn.Module, name: str) -> nn.Module:
    parent_path = name.rpartition(".")[0]
    return root.get_submodule(parent_path) if parent_path else root
