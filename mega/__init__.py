"""mega: train large transformer language models the Megatron-LM way, with plugins.

Importing ``mega`` is cheap (no torch): plugin modules import it for ``hookimpl`` and the specs.
"""

from __future__ import annotations

import pluggy

from mega.core.plugins.specs import (
    BuildContext,
    CheckpointBackendSpec,
    DataRequest,
    DatasetSpec,
    DatasetSplits,
    ModelSpec,
    PipelineScheduleSpec,
    TokenizerSpec,
)

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("mega")

__all__ = [
    "BuildContext",
    "CheckpointBackendSpec",
    "DataRequest",
    "DatasetSpec",
    "DatasetSplits",
    "ModelSpec",
    "PipelineScheduleSpec",
    "TokenizerSpec",
    "__version__",
    "hookimpl",
]
