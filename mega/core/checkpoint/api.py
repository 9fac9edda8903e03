"""Sharded checkpoints from Python, as megatron-core's ``dist_checkpointing.save/load``.

    from mega.core.checkpoint.api import load, save, sharded_state

    state = sharded_state(model, topology)     # this rank's pieces of every global tensor
    save(state, "ckpt/")                       # every rank calls it; each writes its pieces
    load(state, "ckpt/")                       # fills the model in place, at any layout

``model`` is a model as mega's parallel library leaves it (``apply_tensor_parallel``,
``split_for_pipeline``): parameters keep their full-model names and tensor-parallel ones carry
their ``shard``. A directory written at one layout loads at another: every rank reads only its
own boxes of the global arrays. ``save`` writes into a hidden sibling and renames it into place
after ``metadata.json`` and ``complete.json``, so a crash never leaves a directory that looks
complete. ``extra`` (plain values, small tensors) rides along in ``metadata.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mega.core.checkpoint.sharded_store import load_sharded, start_sharded_save
from mega.core.checkpoint.store import MARKER
from mega.errors import MegaUsageError
from mega.parallel.sharded import ShardedTensor


def sharded_state(
    model: Any, topology: Any = None, vocab_rows: dict[str, int] | None = None
) -> dict[str, ShardedTensor]:
    """``{key: ShardedTensor}`` of ``model``'s parameters on this rank (one process: no
    ``topology`` needed). ``vocab_rows``: ``{name: rows}`` of parameters to store without
    their padding rows."""
    from mega.parallel.sharded_state import training_tensors
    from mega.parallel.topology import Topology

    tensors = training_tensors(
        model, None, topology or Topology(), vocab_rows or {}, with_optimizer=False
    )
    return {t.key: t for t in tensors}


def _backend(name: str) -> Any:
    from mega.core.plugins.manager import make_plugins

    backends = make_plugins().checkpoint_backends
    if name not in backends or not backends.get(name).sharded:
        sharded = [n for n in backends if backends.get(n).sharded]
        raise MegaUsageError(f"no sharded checkpoint backend {name!r} (have: {', '.join(sharded)})")
    return backends.get(name)


def save(
    state: dict[str, ShardedTensor],
    directory: str | Path,
    *,
    backend: str = "zarr",
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` as the checkpoint ``directory`` (a collective: every rank calls it)."""
    chosen = _backend(backend)
    pending = start_sharded_save(
        Path(directory), 0, list(state.values()), dict(extra or {}), {}, chosen
    )
    return pending.finish()


def load(state: dict[str, ShardedTensor], directory: str | Path) -> dict[str, Any]:
    """Fill ``state``'s pieces, in place, from the checkpoint ``directory``; returns the
    ``extra`` it was saved with. Strict: a stored tensor that belongs to no parameter in
    ``state`` (on any rank), or a parameter that is not stored, is a ``MegaUsageError`` naming
    them; with torch.distributed initialised every rank calls it (the ranks pool their keys)."""
    directory = Path(directory)
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise MegaUsageError(f"{directory}: not a complete checkpoint ({exc})") from None
    metadata = load_sharded(directory, marker, list(state.values()), _backend(marker["backend"]))
    return metadata["common"]
