"""``mega-torch``: the one-file checkpoint of ``mega train --ckpt-format torch`` (``state.pt``)
as a ``mega convert-checkpoint`` format, both ways.

Read: the model's tensors, memory-mapped (a tensor is read when the writer asks for it), and the
run's config. Written: a weights-only checkpoint at iteration 0 that ``mega train --load D
--finetune --use-checkpoint-args`` starts from in one process. ``torch.save`` writes one pickle,
so writing holds the whole model in memory; the sharded ``mega`` format streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import LazyTensor, ModelWeights
from mega.errors import MegaUsageError

BACKEND = "torch"


def _backends() -> Any:
    from mega.core.plugins.manager import make_plugins

    return make_plugins().checkpoint_backends


def detect(path: Path) -> bool:
    from mega.core.checkpoint.store import peek_marker

    found = peek_marker(path)
    return found is not None and found[1].get("backend") == BACKEND


def read(path: Path) -> ModelWeights:
    import torch

    from mega.core.checkpoint.store import peek_marker, unpadded_model, verify_files
    from mega.plugins.checkpoint.torch_files import FILE

    found = peek_marker(path)
    if found is None or found[1].get("backend") != BACKEND:
        raise MegaUsageError(f"{path}: not a --ckpt-format {BACKEND} checkpoint")
    directory = found[0]
    verify_files(directory, found[1])
    state = torch.load(directory / FILE, map_location="cpu", weights_only=True, mmap=True)
    tensors = {
        name: LazyTensor(tuple(t.shape), t.dtype, lambda t=t: t.clone())
        for name, t in unpadded_model(state, directory).items()
    }
    return ModelWeights.from_run_config(state.get("config") or {}, tensors, str(directory))


def write(path: Path, weights: ModelWeights) -> None:
    from mega.core.checkpoint.store import save_checkpoint

    state = {
        "iteration": 0,
        "weights_only": True,
        "vocab_unpadded": True,
        "config": weights.config(),
        "model": {name: t.load() for name, t in weights.tensors.items()},
    }
    save_checkpoint(path, 0, state, _backends().get(BACKEND))


@hookimpl
def register_checkpoint_converters(register):
    register(
        CheckpointConverterSpec(
            name="mega-torch",
            read=read,
            write=write,
            detect=detect,
            description="mega's one-file checkpoint (--ckpt-format torch, state.pt)",
        )
    )
