"""Put context-parallel attention in place of a model's core attention, from its parallel plan.

The plan's ``core_attention`` modules (parameter-free: ``(query, key, value, mask)`` ->
``[b, s, heads*d]``) are wrapped: the wrapper hands this rank's queries, keys and values to the
communication type's ``attend``, which returns this rank's positions' context. Every other
module is unchanged: it sees the rank's positions as if they were the sequence (and
``position_ids`` say where they are: :mod:`.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mega.parallel import comm
from mega.parallel.plan import ParallelPlan
from mega.parallel.tensor.apply import matching_paths
from mega.parallel.topology import Topology

# attend(query [b, s_local, h, d], key/value [b, s_local, g, d], core_attention) -> [b, s_local, h*d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]


class ContextParallelAttention(nn.Module):
    """The core attention over a sequence split across the context-parallel group."""

    def __init__(self, inner: nn.Module, attend: Attend, comm_type: str) -> None:
        super().__init__()
        self.inner = inner
        self.attend = attend
        self.comm_type = comm_type

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:  # refused before launch (checks.py); a library caller
            raise ValueError("context parallelism supports causal attention without a mask")
        return self.attend(query, key, value, self.inner)

    def extra_repr(self) -> str:
        return f"comm_type={self.comm_type}"


def cp_peers(topology: Topology) -> tuple[int, int]:
    """The global ranks of the next and the previous member of this rank's cp group (a ring)."""
    members = topology.members["cp"]
    index = members.index(topology.rank)
    return members[(index + 1) % len(members)], members[(index - 1) % len(members)]


def apply_context_parallel(
    model: nn.Module,
    plan: ParallelPlan,
    topology: Topology,
    build: Callable[..., Attend],
    name: str,
) -> int:
    """Wrap every core attention of ``model`` for the cp group; ``build(group, rank, size,
    peers)`` is the communication type's (its spec's ``build``). Returns how many were wrapped;
    a cp size of 1 wraps none."""
    cp = topology.context_parallel_size
    if cp == 1:
        return 0
    attend = build(topology.group("cp"), topology.group_rank("cp"), cp, cp_peers(topology))
    paths = matching_paths(model, plan.core_attention)
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, child, ContextParallelAttention(parent.get_submodule(child), attend, name))
    return len(paths)


def context_parallel_loss(parts: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
    """A rank's loss parts (each a masked mean over its positions) as its share of the
    micro-batch's: the value is the micro-batch's (summed over ``group``, for the iteration
    line), the gradient that of this rank's share ``weight * parts`` (summed over ``cp`` with the
    gradients: ``dpcp``)."""
    share = parts * weight
    total = share.detach().clone()
    comm.all_reduce(total, group)
    return share + (total - share.detach())
