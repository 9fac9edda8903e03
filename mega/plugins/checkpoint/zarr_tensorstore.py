"""The ``zarr`` checkpoint backend: one zarr v3 array per global tensor, written through tensorstore.

``iter_0000100/model/decoder.layers.0.mlp.linear_fc1.weight/`` is a plain zarr v3 array (its
``zarr.json`` and chunk files ``c/i/j``): raw little-endian values plus a crc32c per chunk, so
a flipped or truncated chunk is an error on load, never silently different weights. Missing
chunks are errors too (``fill_missing_data_reads`` off; all-zero chunks are written anyway).
Any zarr v3 reader opens an array; bf16 is zarr's ``bfloat16`` extension type.

Chunks follow the writing layout's shards (``ShardedTensor.chunks``), cut to at most
``CHUNK_BYTES`` (``mega.core.checkpoint.shared_chunks.chunk_grid``), so ranks write disjoint
chunk files. Distributed-optimizer ranges end anywhere,
so two ranks' pieces can fall in one chunk: the save gathers such a chunk at one rank, which
writes it whole (``mega/core/checkpoint/shared_chunks.py``; read-modify-write of a shared chunk
by two ranks halved the save's speed at DP2).

tensorstore aborts a process that uses it after a ``fork()`` from a parent that had used it:
:func:`note_fork_unsafe` tells mega's launcher and test ranks to spawn instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega import CheckpointBackendSpec, hookimpl
from mega.errors import first_line
from mega.parallel.fork_safety import note_fork_unsafe
from mega.parallel.sharded import dtype_name

READ_WINDOW_BYTES = 1 << 30  # reads in flight at once: bounds the host memory a load takes


def _ts():
    import tensorstore

    note_fork_unsafe("tensorstore")
    return tensorstore


def _numpy(tensor: Any) -> Any:
    """A host numpy array of ``tensor``'s values (bf16 as ml_dtypes' bfloat16)."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _torch(array: Any) -> Any:
    import numpy as np
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _spec(path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        # absolute: tensorstore refuses a path with `..` in it (`--load ../ckpt`)
        "kvstore": {"driver": "file", "path": str(path.resolve())},
        "fill_missing_data_reads": False,  # a lost chunk is an error, never zeros
        **extra,
    }


GROUP = '{"zarr_format": 3, "node_type": "group", "attributes": {}}\n'


def _groups(directory: Path, keys: list[str]) -> None:
    """zarr v3 group nodes for the directories above the arrays, so that ``zarr.open_group``
    lists the checkpoint's tree. Every creating rank writes the same bytes, each file atomically."""
    from mega.core.checkpoint.store import atomic_write_text

    groups = {""}
    for key in keys:
        parts = key.split("/")[:-1]
        groups.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    for group in sorted(groups):
        path = directory / group / "zarr.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            atomic_write_text(path, GROUP)


def create(directory: Path, tensors: list[Any]) -> None:
    """Create the empty global arrays of ``tensors`` (their metadata only), and the zarr groups
    above them."""
    import torch

    # the one chunk rule, which the save's gathering of shared chunks plans with too
    from mega.core.checkpoint.shared_chunks import chunk_grid

    ts = _ts()
    _groups(directory, [t.key for t in tensors])
    futures = []
    for t in tensors:
        itemsize = torch.empty((), dtype=t.dtype).element_size()
        metadata = {
            "shape": list(t.global_shape),
            "data_type": dtype_name(t.dtype),
            "chunk_grid": {
                "name": "regular",
                "configuration": {
                    "chunk_shape": list(chunk_grid(t.global_shape, t.chunks, itemsize))
                },
            },
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "fill_value": 0,
        }
        futures.append(ts.open(_spec(directory / t.key, metadata=metadata), create=True))
    for future in futures:
        future.result()


def write(directory: Path, tensors: list[Any]) -> Any:
    """Start writing every piece of ``tensors`` into their arrays; returns a function that waits
    for the writes and raises the first failure. The pieces' values do not change until then,
    so tensorstore writes from them without copying them first."""
    ts = _ts()
    pending = []
    opened = [
        (t, ts.open(_spec(directory / t.key, store_data_equal_to_fill_value=True), open=True))
        for t in tensors
    ]
    for t, future in opened:
        array = future.result()
        for piece in t.pieces:
            values = _numpy(piece.data)
            box = tuple(slice(s, s + n) for s, n in zip(piece.start, values.shape, strict=True))
            future = array[box].write(values, can_reference_source_data_indefinitely=True)
            pending.append((t.key, future, values))

    def wait() -> None:
        for key, future, _ in pending:
            try:
                future.result()
            except Exception as exc:  # tensorstore's errors are ValueError/OSError-like
                raise OSError(f"{key}: {first_line(exc)}") from None

    return wait


def read(directory: Path, tensors: list[Any]) -> None:
    """Fill every piece of ``tensors`` from the stored arrays (their ``key``s), in place."""
    ts = _ts()
    opened = []
    for t in tensors:
        opened.append((t, ts.open(_spec(directory / t.key), open=True, read=True)))
    window: list[tuple[Any, Any, Any]] = []
    in_flight = 0

    def drain() -> None:
        for key, piece, future in window:
            try:
                values = future.result()
            except Exception as exc:
                raise OSError(f"{key}: {first_line(exc)}") from None
            piece.data.copy_(_torch(values))
        window.clear()

    for t, future in opened:
        try:
            array = future.result()
        except Exception as exc:
            raise OSError(f"{t.key}: {first_line(exc)}") from None
        if tuple(array.shape) != tuple(t.global_shape):
            raise OSError(
                f"{t.key}: stored shape {tuple(array.shape)}, this model's {tuple(t.global_shape)}"
            )
        for piece in t.pieces:
            shape = tuple(piece.data.shape)
            box = tuple(slice(s, s + n) for s, n in zip(piece.start, shape, strict=True))
            window.append((t.key, piece, array[box].read()))
            in_flight += piece.data.numel() * piece.data.element_size()
            if in_flight > READ_WINDOW_BYTES:
                drain()
                in_flight = 0
    drain()


@hookimpl
def register_checkpoint_backends(register):
    register(
        CheckpointBackendSpec(
            name="zarr",
            create=create,
            write=write,
            read=read,
            description="sharded zarr v3 arrays of the global tensors, written by tensorstore;"
            " reshards on load",
        )
    )
