"""Tensor parallelism (and sequence parallelism) for models that provide a ParallelPlan.

One job per file: ``mappings`` (autograd collectives), ``linear`` (column/row-parallel linears),
``embedding`` (vocab-parallel embedding), ``cross_entropy`` and ``head`` (the vocab-parallel loss),
``rng`` (the TP RNG tracker), ``regions`` (RNG and sequence-scatter wrappers), ``apply`` (the
rewrite), ``gather`` (reassembling global tensors), ``validate`` (layout checks).

Importing this package does not import torch: ``sequence_parallel_problems`` runs during config
validation; the torch-backed functions load on first use.
"""

from __future__ import annotations

from typing import Any

from mega.parallel.tensor.validate import sequence_parallel_problems

__all__ = [
    "apply_tensor_parallel",
    "gather_full_parameters",
    "gather_full_tensor",
    "sequence_parallel_problems",
]

_LAZY = {
    "apply_tensor_parallel": "mega.parallel.tensor.apply",
    "gather_full_parameters": "mega.parallel.tensor.gather",
    "gather_full_tensor": "mega.parallel.tensor.gather",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
