"""``mega checkpoint inspect DIR``: what a checkpoint holds, read from its JSON files only.

DIR is a save directory (its latest complete checkpoint) or one ``iter_*`` directory. Printed:
the iteration, the backend, the layout it was written with, and for a sharded checkpoint every
tensor with its global shape, dtype and bytes on disk (``--json``: one JSON document). Nothing
is unpickled and no tensor is read, so it is instant and safe on any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mega import hookimpl
from mega.errors import MegaUsageError


def _bytes_on_disk(path: Path) -> int:
    """A file's size, or the sum of the files under a directory (a zarr array)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe(directory: Path) -> dict[str, Any]:
    """The checkpoint in ``directory`` as plain data (see the module docstring)."""
    from mega.core.checkpoint.sharded_store import METADATA
    from mega.core.checkpoint.store import MARKER

    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise MegaUsageError(f"{directory}: unreadable {MARKER} ({exc})") from None
    info: dict[str, Any] = {
        "directory": str(directory),
        "iteration": marker.get("iteration"),
        "backend": marker.get("backend"),
        "sharded": bool(marker.get("sharded")),
    }
    if not info["sharded"]:
        info["files"] = {name: _bytes_on_disk(directory / name) for name in marker["files"]}
        return info
    try:
        metadata = json.loads((directory / METADATA).read_text())
    except (OSError, ValueError) as exc:
        raise MegaUsageError(f"{directory}: unreadable {METADATA} ({exc})") from None
    info["layout"] = metadata.get("common", {}).get("layout", {})
    # a backend's arrays: mega's own store each at its key's path; a plugin's may store them
    # elsewhere (one file, other names): then a tensor's bytes are unknown (None) and the total
    # is the directory's files
    info["tensors"] = {
        key: {
            "shape": meta["shape"],
            "dtype": meta["dtype"],
            "bytes": _bytes_on_disk(directory / key) if (directory / key).exists() else None,
        }
        for key, meta in sorted(metadata["tensors"].items())
    }
    info["bytes_on_disk"] = _bytes_on_disk(directory)
    return info


SHORT = {
    "world_size": "world", "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp", "data_parallel_size": "dp",
    "context_parallel_size": "cp", "expert_model_parallel_size": "ep",
    "virtual_pipeline_model_parallel_size": "vpp", "sequence_parallel": "sp",
    "use_distributed_optimizer": "distributed optimizer",
}  # fmt: skip


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@click.group("checkpoint")
def checkpoint_group() -> None:
    """Look inside mega checkpoints."""


@checkpoint_group.command("inspect")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def inspect_command(directory: Path, as_json: bool) -> None:
    """Iteration, layout, and every tensor's shape, dtype and bytes of a checkpoint."""
    from mega.core.checkpoint.store import find_checkpoint

    found = find_checkpoint(directory) if directory.is_dir() else None
    if found is None:
        raise MegaUsageError(f"{directory}: no complete checkpoint there")
    info = describe(found)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    click.echo(f"checkpoint {info['directory']}: iteration {info['iteration']}, {info['backend']}")
    layout = info.get("layout") or {}
    if layout:
        sizes = ", ".join(f"{SHORT.get(k, k)} {v}" for k, v in layout.items())
        click.echo(f"written with: {sizes}")
    if not info["sharded"]:
        for name, size in info["files"].items():
            click.echo(f"  {name}  {_size(size)}")
        return
    tensors = info["tensors"]
    width = max((len(k) for k in tensors), default=0)
    for key, meta in tensors.items():
        shape = "x".join(map(str, meta["shape"])) or "scalar"
        size = "?" if meta["bytes"] is None else _size(meta["bytes"])
        click.echo(f"  {key:<{width}}  {shape:>14}  {meta['dtype']:<8}  {size}")
    click.echo(f"{len(tensors)} tensors, {_size(info['bytes_on_disk'])} on disk")


@hookimpl
def register_commands(register: Any) -> None:
    register(checkpoint_group)
