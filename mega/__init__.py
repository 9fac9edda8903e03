"""mega: train large transformer language models the Megatron-LM way, with plugins.

Importing ``mega`` is cheap (no torch): plugin modules import it for ``hookimpl`` and the specs.
This module is the plugin API: everything a plugin author needs is importable from here, and a
name keeps this path when its home inside the package moves. The names that need torch or more
of the package (``Engine``, ``normal_``, ``make_plugins``, the schedule actions, ...) load on
first use.
"""

from __future__ import annotations

from typing import Any

from mega.core.config.fields import option
from mega.core.plugins.hookspecs import hookimpl
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
    OptimizerSpec,
    PipelineScheduleSpec,
    TokenizerSpec,
)
from mega.errors import MegaRunError, MegaUsageError
from mega.parallel.attention_spec import AttentionKernelSpec
from mega.parallel.dimension import ParallelDimension
from mega.parallel.plan import ParallelPlan

__version__ = "0.1.0"

# Loaded on first use (``mega --help`` and plugin discovery must not pay for them, and some
# import torch): name -> the module defining it.
_LAZY = {
    "normal_": "mega.core.training.init",
    # running mega from Python (tests, notebooks)
    "make_plugins": "mega.core.plugins.manager",
    "resolve_config": "mega.core.config.resolve",
    "Engine": "mega.core.training.engine",
    "StepResult": "mega.core.training.step",
    # checkpoint converters and sharded checkpoint backends
    "LazyTensor": "mega.core.convert.weights",
    "ModelWeights": "mega.core.convert.weights",
    "SourceTensors": "mega.core.convert.weights",
    "Piece": "mega.parallel.sharded",
    "ShardedTensor": "mega.parallel.sharded",
    # pipeline schedules: the actions of a table, placing transfers, proving a table runs
    "Action": "mega.parallel.pipeline.actions",
    "Backward": "mega.parallel.pipeline.actions",
    "Compute": "mega.parallel.pipeline.actions",
    "Forward": "mega.parallel.pipeline.actions",
    "RecvActivation": "mega.parallel.pipeline.actions",
    "RecvGrad": "mega.parallel.pipeline.actions",
    "SendActivation": "mega.parallel.pipeline.actions",
    "SendGrad": "mega.parallel.pipeline.actions",
    "Table": "mega.parallel.pipeline.actions",
    "WeightGrad": "mega.parallel.pipeline.actions",
    "p2p_batches": "mega.parallel.pipeline.actions",
    "split_weight_grads": "mega.parallel.pipeline.actions",
    "with_p2p": "mega.parallel.pipeline.placement",
    "ScheduleError": "mega.parallel.pipeline.simulator",
    "SimulationResult": "mega.parallel.pipeline.simulator",
    "simulate": "mega.parallel.pipeline.simulator",
}

# Names that were public here once and are gone, with what replaced them.
_REMOVED = {
    "ParallelSpec": (
        "mega.ParallelSpec was removed on 2026-11-23: a --parallel schedule is now a"
        " mega.PipelineScheduleSpec, a table of actions registered with the"
        " register_parallel_choices hook (one executor runs every table; see 'Schedules' in docs/plugins.md), and where"
        " tensor/sequence/pipeline parallelism cut a model is its ModelSpec.parallel_plan"
    ),
}

__all__ = [
    "AttentionKernelSpec",
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
    "OptimizerSpec",
    "ParallelDimension",
    "ParallelPlan",
    "PipelineScheduleSpec",
    "TokenizerSpec",
    "__version__",
    "hookimpl",
    "option",
    *_LAZY,  # loaded on first use
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # looked up once
        return value
    if name in _REMOVED:
        raise ImportError(_REMOVED[name], name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
