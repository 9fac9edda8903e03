"""Megatron-LM's ``--ckpt-format torch_dist`` checkpoints: PyTorch DCP files (``.metadata`` and
``__*_*.distcp``) that hold every tensor as a global one, whatever TP/PP saved it.

mcore stacks a decoder's (homogeneous) layers on a leading axis (``decoder.layers.mlp
.linear_fc2.weight`` is ``[num_layers, h, ffn]``) and stores SwiGLU's ``linear_fc1`` already as
the global ``[gate(all); up(all)]`` (a ShardedTensorFactory cuts each rank's ``[gate_r; up_r]``
in two). Each layer is read on its own: only the DCP chunks that overlap it, with no process
group.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mega.core.convert.weights import LazyTensor
from mega.core.errors import MegaUsageError


class _Reader(FileSystemReader):
    """A DCP reader that reads ``.metadata`` once per conversion, not once per tensor."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


class _BoxPlanner(DefaultLoadPlanner):
    """Reads one box of a global tensor (at ``offsets``, the size of ``out``) into ``out``,
    from only the chunks that overlap it."""

    def __init__(self, key: str, offsets: list[int], out: torch.Tensor) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.key, self.offsets, self.out = key, offsets, out

    def create_local_plan(self) -> LoadPlan:
        box = ChunkStorageMetadata(torch.Size(self.offsets), self.out.shape)
        meta = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, meta, [box]))

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        box = self.out
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            box = box.narrow(dim, start, length)
        return box


def dcp_tensor(directory: Path, metadata: Metadata, key: str, index: int | None) -> LazyTensor:
    """The global tensor ``key`` of a DCP checkpoint, or its ``index``-th slice along the first
    axis (where Megatron stacks a decoder's layers); read alone, without a process group."""
    meta = metadata.state_dict_metadata[key]
    size, offsets = list(meta.size), [0] * len(meta.size)
    if index is not None:
        offsets[0], size[0] = index, 1

    def load() -> torch.Tensor:
        out = torch.empty(size, dtype=meta.properties.dtype)
        planner = _BoxPlanner(key, offsets, out)
        reader = _Reader(directory, metadata)
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp_load({key: out}, storage_reader=reader, planner=planner, no_dist=True)
        return out[0] if index is not None else out

    shape = tuple(size[1:] if index is not None else size)
    return LazyTensor(shape, meta.properties.dtype, load)


def dcp_tensors(directory: Path, layers: int) -> dict[str, LazyTensor]:
    """The model tensors of a torch_dist checkpoint under Megatron's per-layer global names: a
    key ``decoder.layers.X`` stacked ``[num_layers, ...]`` becomes ``decoder.layers.{i}.X``."""
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise MegaUsageError(f"{directory}/.metadata: cannot read it ({exc})") from None
    for info in metadata.storage_data.values():  # found now, not halfway through writing
        if not (directory / info.relative_path).is_file():
            raise MegaUsageError(f"{directory / info.relative_path}: missing")
    out: dict[str, LazyTensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        # objects (_extra_state, RNG) are not weights; nor is the optimizer state
        if not isinstance(meta, TensorStorageMetadata) or key.startswith("optimizer."):
            continue
        stacked = re.match(r"decoder\.layers\.([a-z_].*)$", key)
        if not stacked:
            out[key] = dcp_tensor(directory, metadata, key, None)
            continue
        if meta.size[0] != layers:
            raise MegaUsageError(
                f"{directory}: {key} stacks {meta.size[0]} layers, args say {layers}"
            )
        for i in range(layers):
            out[f"decoder.layers.{i}.{stacked.group(1)}"] = dcp_tensor(directory, metadata, key, i)
    return out
