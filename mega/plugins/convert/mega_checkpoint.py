"""``mega`` checkpoints as a ``mega convert-checkpoint`` format: the sharded (zarr) checkpoint
that ``mega train --save`` writes, read one tensor at a time, and written as a weights-only
checkpoint at iteration 0 that ``mega train --load D --finetune --use-checkpoint-args`` starts
from (the architecture flags come from its config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import LazyTensor, ModelWeights
from mega.errors import MegaUsageError

PREFIX = "model/"


def _backends() -> Any:
    from mega.core.plugins.manager import make_plugins

    return make_plugins().checkpoint_backends


def detect(path: Path) -> bool:
    from mega.core.checkpoint.store import peek_marker

    found = peek_marker(path)  # a one-file (--ckpt-format torch) one is mega-torch's
    return found is not None and bool(found[1].get("sharded"))


def read(path: Path) -> ModelWeights:
    import torch

    from mega.core.checkpoint.sharded_store import read_metadata
    from mega.core.checkpoint.store import read_marker
    from mega.parallel.sharded import Piece, ShardedTensor

    directory, marker, backend = read_marker(path, _backends())
    if not marker.get("sharded"):
        raise MegaUsageError(
            f"{directory}: a --ckpt-format {marker.get('backend')} checkpoint, not a sharded one"
            " (read it with --from mega-torch)"
        )
    metadata = read_metadata(directory, marker)
    config = metadata["common"].get("config") or marker.get("config") or {}

    def lazy(key: str, meta: dict[str, Any]) -> LazyTensor:
        shape, dtype = tuple(meta["shape"]), getattr(torch, meta["dtype"])

        def load() -> torch.Tensor:
            values = torch.empty(shape, dtype=dtype)
            piece = Piece((0,) * len(shape), values)
            backend.read(directory, [ShardedTensor(key, shape, dtype, [piece])])
            return values

        return LazyTensor(shape, dtype, load)

    tensors = {
        key.removeprefix(PREFIX): lazy(key, meta)
        for key, meta in metadata["tensors"].items()
        if key.startswith(PREFIX)
    }
    return ModelWeights.from_run_config(config, tensors, str(directory))


def write(path: Path, weights: ModelWeights) -> None:
    from mega.core.checkpoint.sharded_store import save_streamed
    from mega.core.checkpoint.store import iteration_dir, write_tracker
    from mega.parallel.sharded import ShardedTensor

    tensors = [
        (ShardedTensor(PREFIX + name, t.shape, t.dtype), t.load)
        for name, t in weights.tensors.items()
    ]
    common = {"iteration": 0, "weights_only": True, "config": weights.config()}
    save_streamed(iteration_dir(path, 0), 0, tensors, common, _backends().get("zarr"))
    write_tracker(path, 0)


@hookimpl
def register_checkpoint_converters(register):
    register(
        CheckpointConverterSpec(
            name="mega",
            read=read,
            write=write,
            detect=detect,
            description="mega's sharded zarr checkpoint (a --save directory or one iter_*)",
        )
    )
