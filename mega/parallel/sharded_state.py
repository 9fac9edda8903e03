"""A rank's model and optimizer as global tensors (``ShardedTensor``) for sharded checkpoints.

Keys are layout-free: ``model/<parameter>`` with the full model's parameter names (pipeline
ranks keep them), and ``optimizer/<state>/<parameter>`` for ``exp_avg``, ``exp_avg_sq`` (SGD:
``momentum``) and, in bf16/fp16 runs, the fp32 ``master``. Every tensor has its global shape:
tensor-parallel shards are placed by their ``ShardSpec``, distributed-optimizer ranges by their
flat position, and vocabulary-sized tensors lose the padding rows (whose number depends on TP).

Who writes what is decided here, identically on every rank, so each value is written once:

- a tensor-parallel replicated tensor (a norm weight, a row-parallel bias): TP rank 0;
- the last pipeline stage's copy of a tied embedding: never (the first stage writes it);
- a tensor that every data-parallel rank holds (the model, the optimizer without
  ``--use-distributed-optimizer``): one DP rank per tensor, the largest tensors first to the
  rank with the fewest bytes so far, so the writing is spread by size (an expert-parallel
  tensor: one expert-data-parallel rank, each EP rank its experts);
- a distributed-optimizer range: the rank that owns it.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch

from mega.parallel.boxes import flat_boxes, global_shape, place
from mega.parallel.shard import ShardSpec
from mega.parallel.sharded import Piece, ShardedTensor
from mega.parallel.topology import Topology


def vocab_rows(
    model: torch.nn.Module, names: tuple[str, ...], vocab: int, padded: int
) -> dict[str, int]:
    """``{name: vocab}`` for the model's parameters among ``names`` (its plan's
    ``vocab_parameters``: rows are the padded vocabulary) when there is padding to cut."""
    if vocab == padded:
        return {}
    return {name: vocab for name, _ in model.named_parameters() if name in names}


def _chunks(spec: ShardSpec | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """One chunk per shard piece along the split dimension (whole along the others)."""
    if spec is None:
        return shape
    chunks = list(shape)
    chunks[spec.split_dim] = spec.piece
    return tuple(chunks)


def _pieces(
    flat: torch.Tensor, shape: tuple[int, ...], lo: int, hi: int, spec: Any, rows: Any
) -> list[Piece]:
    """The pieces of the flat range ``[lo, hi)`` of a local tensor of ``shape`` whose values
    are ``flat`` (``flat[0]`` is element ``lo``)."""
    pieces = []
    for box in flat_boxes(shape, lo, hi):
        start = box.flat - lo
        data = flat[start : start + prod(box.shape)].view(box.shape)
        pieces += [Piece(s, v) for s, v in place(data, box.start, spec, rows)]
    return pieces


def replica_writers(model: torch.nn.Module, size: int, expert: bool) -> dict[str, int]:
    """Which of ``size`` replica ranks writes each parameter (expert-parallel ones when
    ``expert``, the rest otherwise): largest first, each to the rank with the fewest bytes so
    far (ties: the lowest rank). Taking turns by index gave DP rank 0 of a GPT every large
    matrix (each layer has 12 parameters, its four weights at even positions): on 2 H100 it
    wrote 10.5 GB of a 1.3B GPT's checkpoint and rank 1 7.9, and the save waits for the
    slowest. The same on every rank of the group: it reads only the names and shapes."""
    params = [
        (name, param.numel() * param.element_size())
        for name, param in model.named_parameters()
        if bool(getattr(param, "expert_parallel", False)) == expert
    ]
    load, writers = [0] * size, {}
    for name, nbytes in sorted(params, key=lambda item: -item[1]):  # stable: ties by order
        rank = min(range(size), key=lambda r: load[r])
        writers[name] = rank
        load[rank] += nbytes
    return writers


def training_tensors(
    model: torch.nn.Module,
    optimizer: Any,
    topology: Topology,
    rows: dict[str, int],
    *,
    with_optimizer: bool = True,
    for_load: bool = False,
) -> list[ShardedTensor]:
    """This rank's ``ShardedTensor``s of ``model`` and its ``optimizer`` (a
    ``FlatOptimizer``). ``for_load``: the keys a load reads first (in an fp32 run the
    parameters prefer a checkpoint's fp32 masters to its bf16 weights)."""
    # the ranks holding the same dense weights take turns writing them
    dp, dp_rank = topology.data_context_parallel_size, topology.group_rank("dpcp")
    tp_rank = topology.tp_rank
    edp, edp_rank = topology.expert_data_context_parallel_size, topology.group_rank("edpcp")
    distributed = optimizer is not None and optimizer.buffer.distributed
    states = optimizer.flat_states() if with_optimizer and optimizer is not None else {}
    mixed = "master" in states
    dense_writer = replica_writers(model, dp, expert=False)
    expert_writer = replica_writers(model, edp, expert=True)
    tensors = []
    for name, param in model.named_parameters():
        spec = getattr(param, "shard", None)
        row_limit = rows.get(name)
        shape = global_shape(spec, tuple(param.shape), row_limit)
        chunks = _chunks(spec, shape)
        # written by one rank: TP rank 0 for replicated tensors, never the tied copy
        tp_split = spec is not None and spec.group == "tp"
        unique = (tp_split or tp_rank == 0) and not getattr(param, "tied_copy", False)
        if getattr(param, "expert_parallel", False):  # replicas: the expert-data-parallel ranks
            replica_turn = expert_writer[name] == edp_rank
        else:
            replica_turn = dense_writer[name] == dp_rank
        data = param.detach()
        start = (0,) * data.dim()
        key, fallback = f"model/{name}", None
        if for_load and not mixed and param.dtype == torch.float32:
            # an fp32 run reads a bf16 checkpoint's fp32 masters rather than its bf16 weights
            key, fallback = f"optimizer/master/{name}", key
        tensors.append(
            ShardedTensor(
                key=key,
                global_shape=shape,
                dtype=param.dtype,
                pieces=[Piece(s, v) for s, v in place(data, start, spec, row_limit)],
                write=unique and replica_turn,
                chunks=chunks,
                fallback=fallback,
            )
        )
        for state, flat in states.items():
            pieces = []
            for lo, hi, offset in optimizer.state_ranges(param):
                values = flat[offset : offset + hi - lo]
                pieces += _pieces(values, tuple(param.shape), lo, hi, spec, row_limit)
            tensors.append(
                ShardedTensor(
                    key=f"optimizer/{state}/{name}",
                    global_shape=shape,
                    dtype=flat.dtype,  # fp32, or bf16/fp16 moments (precision-aware)
                    pieces=pieces,
                    write=unique and (distributed or replica_turn),
                    chunks=chunks,
                    # a checkpoint written in fp32 has no masters: the weights are the masters
                    fallback=f"model/{name}" if state == "master" else None,
                )
            )
    return tensors


def fp8_scaling_tensors(scaling: Any, topology: Topology) -> list[ShardedTensor]:
    """``--fp8-recipe delayed``'s amax histories and scales (``mega.parallel.fp8.delayed``) as
    ``fp8/<module path>.amax_history`` and ``.scale``: equal on every rank that holds the layer
    (they are max-reduced over its data, context and tensor parallel ranks), so the first of
    those writes them; optional, so a checkpoint without them loads (the first step seeds)."""
    writer = topology.tp_rank == 0 and topology.group_rank("dpcp") == 0
    return [
        ShardedTensor(
            key=f"fp8/{key}",
            global_shape=tuple(buffer.shape),
            dtype=buffer.dtype,
            pieces=[Piece((0,) * buffer.dim(), buffer)],
            write=writer,
            optional=True,
        )
        for key, buffer in scaling.state().items()
    ]
