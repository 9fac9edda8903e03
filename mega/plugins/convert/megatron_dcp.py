"""Megatron-LM's ``--ckpt-format torch_dist`` checkpoints: PyTorch DCP files (``.metadata`` and
``__*_*.distcp``) that hold every tensor as a global one, whatever TP/PP saved it.

mcore stacks a decoder's (homogeneous) layers on a leading axis (``decoder.layers.mlp
.linear_fc2.weight`` is ``[num_layers, h, ffn]``) and stores SwiGLU's ``linear_fc1`` already as
the global ``[gate(all); up(all)]`` (a ShardedTensorFactory cuts each rank's ``[gate_r; up_r]``
in two). Each layer is read on its own: only the DCP chunks that overlap it, with no process
group. Written the same way, by one process with no process group: each layer of a stacked key
is one DCP chunk, loaded when DCP's writer comes to it.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mega.core.convert.weights import LazyTensor
from mega.errors import MegaUsageError


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


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Chunk:
    """One piece of a torch_dist tensor of global ``size``: layer ``layer`` of a stacked key
    (``[1, ...]`` at ``[layer, 0, ...]``), or the whole tensor (``layer`` None); ``load`` gives
    its values, without the stacked axis."""

    key: str
    size: tuple[int, ...]
    dtype: torch.dtype
    layer: int | None
    load: Callable[[], torch.Tensor]

    @property
    def offsets(self) -> tuple[int, ...]:
        first = (self.layer or 0,) if self.size else ()
        return first + (0,) * (len(self.size) - 1)

    @property
    def box(self) -> tuple[int, ...]:
        return (1, *self.size[1:]) if self.layer is not None else self.size


class _ChunkPlanner(DefaultSavePlanner):
    """Plans the write of ``Chunk``s and ``objects`` (key -> a pickled object, as mcore stores
    its ShardedObjects) without holding their values: ``resolve_data`` loads each when DCP's
    writer comes to it, one at a time."""

    def __init__(self, chunks: list[Chunk], objects: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {(c.key, c.offsets): c for c in chunks}
        self.objects = objects

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator=False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), c in self.chunks.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(c.box)),
                        properties=TensorProperties(dtype=c.dtype),
                        size=torch.Size(c.size),
                    ),
                )
            )
        for key in self.objects:
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save(self.objects[index.fqn], data)
            return data
        chunk = self.chunks[(index.fqn, tuple(index.offset))]
        values = chunk.load()
        if chunk.layer is not None:
            values = values.unsqueeze(0)
        if tuple(values.shape) != tuple(chunk.box) or values.dtype != chunk.dtype:
            raise MegaUsageError(
                f"{chunk.key}: loaded {list(values.shape)} {values.dtype}, expected"
                f" {list(chunk.box)} {chunk.dtype}"
            )
        return values.contiguous()


def write_dcp(directory: Path, chunks: list[Chunk], objects: dict[str, Any]) -> None:
    """A torch_dist checkpoint's DCP files (``.metadata``, ``__0_0.distcp``) in ``directory``,
    written by this one process: each chunk is loaded when it is written, so one tensor (one
    layer of a stacked key) is in memory at a time."""
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_save({}, storage_writer=writer, planner=_ChunkPlanner(chunks, objects), no_dist=True)
