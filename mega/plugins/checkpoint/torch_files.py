"""The ``torch`` checkpoint backend: one ``state.pt`` per checkpoint, loaded with weights_only.

``weights_only=True`` restricts unpickling to tensors and plain containers, so a checkpoint can
never run code when it is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mega import CheckpointBackendSpec, hookimpl

FILE = "state.pt"


def _save(directory: Path, state: dict[str, Any]) -> list[str]:
    import torch

    torch.save(state, Path(directory) / FILE)
    return [FILE]


def _load(directory: Path) -> dict[str, Any]:
    import torch

    return torch.load(Path(directory) / FILE, map_location="cpu", weights_only=True)


@hookimpl
def register_checkpoint_backends(register):
    register(
        CheckpointBackendSpec(
            name="torch",
            save=_save,
            load=_load,
            description="single-process torch.save file, loaded with weights_only=True",
        )
    )
