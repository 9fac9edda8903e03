"""``mega`` checkpoints as a ``mega convert-checkpoint`` format: the sharded (zarr) checkpoint
that ``mega train --save`` writes, read one tensor at a time, and written as a weights-only
checkpoint at iteration 0 that ``mega train --load D --finetune --use-checkpoint-args`` starts
from (the architecture flags come from its config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import LazyTensor, ModelWeights
from mega.core.errors import MegaUsageError

PREFIX = "model/"
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def _backends() -> Any:
    from mega.core.plugins.manager import make_plugins

    return make_plugins().checkpoint_backends


def detect(path: Path) -> bool:
    from mega.core.checkpoint.store import find_checkpoint

    return find_checkpoint(path) is not None


def read(path: Path) -> ModelWeights:
    import torch

    from mega.core.checkpoint.sharded import Piece, ShardedTensor
    from mega.core.checkpoint.sharded_store import read_metadata
    from mega.core.checkpoint.store import read_marker

    directory, marker, backend = read_marker(path, _backends())
    if not marker.get("sharded"):
        raise MegaUsageError(
            f"{directory}: a --ckpt-format {marker.get('backend')} checkpoint; convert-checkpoint"
            " reads sharded (zarr) ones: load it in one process and save it with --ckpt-format zarr"
        )
    metadata = read_metadata(directory, marker)
    config = metadata["common"].get("config") or marker.get("config") or {}
    model = dict(config.get("model", {}))
    if not model:
        raise MegaUsageError(f"{directory}: the checkpoint holds no model config")

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
    if WORD_EMBEDDINGS not in tensors:
        raise MegaUsageError(f"{directory}: no {PREFIX}{WORD_EMBEDDINGS} in the checkpoint")
    tokenizer = dict(config.get("tokenizer", {}))
    if config.get("data", {}).get("tokenizer_type"):
        tokenizer["tokenizer_type"] = config["data"]["tokenizer_type"]
    return ModelWeights(
        model=model,
        seq_length=config.get("training", {}).get("seq_length"),
        vocab_size=tensors[WORD_EMBEDDINGS].shape[0],
        tensors=tensors,
        tokenizer=tokenizer,
    )


def write(path: Path, weights: ModelWeights) -> None:
    from mega.core.checkpoint.sharded import ShardedTensor
    from mega.core.checkpoint.sharded_store import save_streamed
    from mega.core.checkpoint.store import iteration_dir, write_tracker

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
