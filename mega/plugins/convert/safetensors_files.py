"""Reading and writing Hugging Face's ``*.safetensors`` files one tensor at a time.

Reading uses the safetensors library (memory-mapped: a tensor is read when asked for). Writing
is done here, because ``safetensors.torch.save_file`` wants every tensor of a file in memory at
once and a 5 GB shard would hold many: the format is an 8-byte little-endian header length, a
JSON header (each tensor's dtype, shape and byte range), then the tensors' raw bytes in order,
so it can be written tensor by tensor. Shards and ``model.safetensors.index.json`` are named as
transformers' ``save_pretrained`` names them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from mega.core.convert.weights import LazyTensor
from mega.errors import MegaUsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def files_of(directory: Path) -> dict[str, Path]:
    """tensor name -> the file holding it, from the index or the single file."""
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE
    if not single.is_file():
        raise MegaUsageError(f"{directory}: no {SINGLE} or {INDEX}")
    return {name: single for name in _header(single)}


def _header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file (name -> dtype, shape, byte range), checked against its
    size: a truncated or garbled file is one line naming it, before anything is written."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                raise ValueError("its header runs past its end")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except OSError as exc:
        raise MegaUsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise MegaUsageError(f"{path}: not a safetensors file ({exc})") from None
    if 8 + length + end != size:
        raise MegaUsageError(
            f"{path}: truncated or corrupt: its header needs {8 + length + end} bytes,"
            f" the file has {size}"
        )
    return header


def read_lazy(directory: Path) -> dict[str, LazyTensor]:
    """Every tensor of the safetensors files in ``directory``, not yet read."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, LazyTensor] = {}
    headers: dict[Path, dict[str, dict]] = {}
    for name, path in files_of(directory).items():
        if path not in headers:
            if not path.is_file():
                raise MegaUsageError(f"{directory}: {path.name} (in {INDEX}) is missing")
            headers[path] = _header(path)
        entry = headers[path].get(name)
        if entry is None:
            raise MegaUsageError(f"{path}: has no tensor {name} (the index says it does)")
        if entry["dtype"] not in DTYPES:
            raise MegaUsageError(f"{path}: {name} has dtype {entry['dtype']}, not supported")

        def load(path: Path = path, name: str = name) -> torch.Tensor:
            try:
                with safe_open(str(path), framework="pt") as f:
                    return f.get_tensor(name)
            except SafetensorError as exc:  # the reader's boundary names the file
                raise OSError(f"{path}: {exc}") from None

        tensors[name] = LazyTensor(tuple(entry["shape"]), DTYPES[entry["dtype"]], load)
    return tensors


def _shards(tensors: dict[str, LazyTensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    return shards


def write_files(
    directory: Path, tensors: dict[str, LazyTensor], max_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write ``tensors`` into ``directory`` as safetensors shards (and their index when there is
    more than one), loading one tensor at a time; returns the files written."""
    shards = _shards(tensors, max_bytes)
    count = len(shards)
    names = (
        [SINGLE]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    for file, shard in zip(names, shards, strict=True):
        _write_one(directory / file, {name: tensors[name] for name in shard})
    if count > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {
                name: file for file, shard in zip(names, shards, strict=True) for name in shard
            },
        }
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


def _write_one(path: Path, tensors: dict[str, LazyTensor]) -> None:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        header[name] = {
            "dtype": NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, t in tensors.items():
            values = t.load()
            if tuple(values.shape) != t.shape or values.dtype != t.dtype:
                raise MegaUsageError(f"{name}: loaded as {list(values.shape)} {values.dtype}")
            f.write(values.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del values
