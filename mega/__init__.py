"""mega: train large transformer language models the Megatron-LM way, with plugins.

Importing ``mega`` is cheap (no torch): plugin modules import it for ``hookimpl`` and the specs.
"""

from __future__ import annotations

from typing import Any

import pluggy

from mega.core.config.fields import option
from mega.core.errors import MegaRunError, MegaUsageError
from mega.core.plugins.specs import (
    BuildContext,
    CheckpointBackendSpec,
    CheckpointConverterSpec,
    CPCommTypeSpec,
    DataRequest,
    DatasetSpec,
    DatasetSplits,
    ModelSpec,
    MoEDispatcherSpec,
    PipelineScheduleSpec,
    TokenizerSpec,
)
from mega.parallel.plan import ParallelPlan

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("mega")

__all__ = [
    "BuildContext",
    "CheckpointBackendSpec",
    "CheckpointConverterSpec",
    "CPCommTypeSpec",
    "DataRequest",
    "DatasetSpec",
    "DatasetSplits",
    "MegaRunError",
    "MegaUsageError",
    "ModelSpec",
    "MoEDispatcherSpec",
    "ParallelPlan",
    "PipelineScheduleSpec",
    "TokenizerSpec",
    "__version__",
    "hookimpl",
    "normal_",
    "option",
]

_LAZY = {"normal_": "mega.core.training.init"}  # torch-backed: loaded on first use


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
