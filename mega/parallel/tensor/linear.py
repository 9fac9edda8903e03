"""Column- and row-parallel linear layers (Megatron's ``ColumnParallelLinear``/``RowParallelLinear``).

Both are built from an initialised full ``nn.Linear`` and keep its parameter names (``weight``,
``bias``), so a model's state-dict keys do not change; each sharded parameter carries a
``shard`` (:class:`mega.parallel.shard.ShardSpec`) saying where it sits in the global tensor.

Column-parallel, ``Y_r = X A_r^T + b_r``: the rank holds ``out/tp`` output rows. Its input is
replicated: identity forward, all-reduce of dX backward; under sequence parallelism the input
arrives as ``[b, s/tp, h]`` and is all-gathered over the tokens (reduce-scatter backward). Its
backward overlaps that collective with the weight-gradient GEMM (``mega.parallel.tensor.
overlapped``), except in FP8, which goes through the mappings and ``mega.parallel.linear``.

Row-parallel, ``Y = sum_r X_r A_r^T + b``: the rank holds ``in/tp`` input columns and its input
is the column-parallel layer's sharded output. The partial products are all-reduced, or
reduce-scattered along the sequence under sequence parallelism; the bias is added after the
reduction, so it is added once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mega.parallel import linear as linear_ops
from mega.parallel.comm import group_size
from mega.parallel.fp8.delayed import sites_of
from mega.parallel.functional_comm import group_name
from mega.parallel.shard import ShardSpec, local_shard
from mega.parallel.tensor.copy_engine_reduce import row_reduce_linear
from mega.parallel.tensor.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence,
)
from mega.parallel.tensor.overlapped import column_parallel_linear
from mega.parallel.tensor.split_choice import COPY_ENGINE, split_chosen, split_value
from mega.parallel.tensor.split_overlap import row_split_linear


def shard_parameter(full: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    """A new parameter holding ``spec``'s slice of ``full``, tagged with ``shard = spec``."""
    param = nn.Parameter(local_shard(full.detach(), spec), requires_grad=full.requires_grad)
    param.shard = spec
    return param


class _ParallelLinear(nn.Module):
    """A linear's shard: its weight (and bias) plus the group that holds the other shards."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: Any,
        sequence_parallel: bool,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.sequence_parallel = sequence_parallel
        # resolved here, not in forward: traced code gets the name as a constant
        self.group_name = None if group is None else group_name(group)
        self.group_size = group_size(group)
        # forward's sequence-parallel collectives split by token block (experimental, opt-in)
        self.split_overlap = sequence_parallel and group is not None and split_chosen()
        # without sequence parallelism: the all-reduces by the copy engine (copy_engine_reduce)
        self.reduce_by_copy_engine = (
            not sequence_parallel and group is not None and split_value() == COPY_ENGINE
        )


class ColumnParallelLinear(_ParallelLinear):
    """``weight [out/tp, in]``, ``bias [out/tp]``; output sharded along its last dim."""

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: Any,
        rank: int,
        size: int,
        *,
        stacked: int = 1,
        sequence_parallel: bool = False,
        comm_overlap: bool = False,
    ) -> ColumnParallelLinear:
        """Keep this rank's output rows of ``linear``; ``stacked`` blocks are split one by one;
        ``comm_overlap``: backward as ``mega.parallel.tensor.overlapped`` (``--tp-comm-overlap``)."""
        spec = ShardSpec(tuple(linear.weight.shape), 0, stacked, rank, size)
        weight = shard_parameter(linear.weight, spec)
        bias = None
        if linear.bias is not None:
            bias = shard_parameter(
                linear.bias, ShardSpec((spec.global_shape[0],), 0, stacked, rank, size)
            )
        layer = cls(weight, bias, group, sequence_parallel)
        layer.comm_overlap = comm_overlap
        return layer

    comm_overlap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [b, s, out/tp]
        # the split forward (split_overlap) lives in the overlapped layer's function
        overlapped = self.comm_overlap or self.split_overlap or self.reduce_by_copy_engine
        overlapped = overlapped and self.group_name is not None
        if overlapped and getattr(self.weight, "fp8_format", None) is None:
            # the backward's collective hidden behind the weight-gradient GEMM
            return column_parallel_linear(
                x,
                self.weight,
                self.bias,
                self.group_name,
                self.group_size,
                self.sequence_parallel,
                self.split_overlap,
            )
        return linear_ops.linear(self.gather_input(x), self.weight, self.bias, sites_of(self))

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """The replicated input this rank's GEMM reads (``mega.parallel.linear.Linear``'s API)."""
        if self.sequence_parallel:
            return gather_from_sequence(x, self.group)  # [b, s/tp, in] -> [b, s, in]
        return copy_to_tensor_parallel(x, self.group)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out/tp={out}, bias={self.bias is not None}, sp={self.sequence_parallel}"


class RowParallelLinear(_ParallelLinear):
    """``weight [out, in/tp]``, ``bias [out]`` (replicated); input sharded along its last dim."""

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: Any, rank: int, size: int, *, sequence_parallel: bool = False
    ) -> RowParallelLinear:
        """Keep this rank's input columns of ``linear``; the bias stays whole."""
        spec = ShardSpec(tuple(linear.weight.shape), 1, 1, rank, size)
        weight = shard_parameter(linear.weight, spec)
        return cls(weight, linear.bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_overlap and getattr(self.weight, "fp8_format", None) is None:
            # [b, s/tp, out]: the GEMM and its reduce-scatter by token blocks
            fused = linear_ops.fuses_wgrad(self.weight)
            out = row_split_linear(x, self.weight, self.group_name, self.group_size, fused)
            return out if self.bias is None else out + self.bias
        if self.reduce_by_copy_engine and getattr(self.weight, "fp8_format", None) is None:
            # [b, s, out]: summed chunk by chunk beside the GEMM (the copy engine's all-reduce)
            fused = linear_ops.fuses_wgrad(self.weight)
            out = row_reduce_linear(x, self.weight, self.group_name, fused)
            return out if self.bias is None else out + self.bias
        # [b, s, out], this rank's share of the sum
        return self.reduce_output(linear_ops.linear(x, self.weight, None, sites_of(self)))

    def reduce_output(self, partial: torch.Tensor) -> torch.Tensor:
        """The output from this rank's partial product: summed over the group (reduce-scattered
        along the sequence under sequence parallelism), then the bias added once."""
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(partial, self.group)  # [b, s/tp, out]
        else:
            out = reduce_from_tensor_parallel(partial, self.group)  # [b, s, out]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in/tp={inp}, out={out}, bias={self.bias is not None}, sp={self.sequence_parallel}"
