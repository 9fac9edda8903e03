"""Reassemble global tensors from tensor-parallel shards (checkpoints, tests, export).

Every rank of the TP group takes part in each gather (collective calls, same order everywhere)
and receives the full tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.parallel.comm import all_gather_into
from mega.parallel.shard import ShardSpec, full_tensor
from mega.parallel.topology import Topology


def gather_full_tensor(shard: torch.Tensor, spec: ShardSpec, topology: Topology) -> torch.Tensor:
    """The global tensor ``spec`` describes, from this rank's ``shard`` and its group's others."""
    group = topology.group(spec.group)
    if group is None:  # a group of one holds the whole tensor
        return full_tensor([shard], spec)
    flat = shard.detach().contiguous().view(-1)
    gathered = flat.new_empty(spec.count * flat.numel())
    all_gather_into(gathered, flat, group)  # every shard is the same size: plain concatenation
    shards = [piece.view(spec.local_shape) for piece in gathered.chunk(spec.count)]
    return full_tensor(shards, spec)


def gather_full_parameters(model: nn.Module, topology: Topology) -> dict[str, torch.Tensor]:
    """``{name: full float32 tensor}`` for every parameter of ``model``, on every TP rank.

    Sharded parameters (those with a ``shard`` attribute) are all-gathered and reassembled;
    replicated ones are copied. Tensors stay on the parameters' device.
    """
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        spec = getattr(param, "shard", None)
        value = param.detach() if spec is None else gather_full_tensor(param, spec, topology)
        full[name] = value.float().clone()
    return full
