"""Whether tensor parallelism's collectives are split into blocks beside the GEMMs, and how
(``MEGA_TP_SPLIT_OVERLAP``: ``1``, sequence parallelism's by NCCL, :mod:`.split_overlap`;
``copy-engine``, by the copy engine, :mod:`.copy_engine_split` with sequence parallelism and
:mod:`.copy_engine_reduce` without). Torch-free, so the
check before launch stays light."""

from __future__ import annotations

import os
from typing import Any

SPLIT_ENV = "MEGA_TP_SPLIT_OVERLAP"
COPY_ENGINE = "copy-engine"  # the blocks by the copy engine
SPLIT_VALUES = ("0", "1", COPY_ENGINE)  # the first is the default


def split_value() -> str:
    return os.environ.get(SPLIT_ENV, SPLIT_VALUES[0])


def split_chosen() -> bool:
    """Whether the environment asks for the split collectives (read when the layers are built)."""
    return split_value() in ("1", COPY_ENGINE)


def split_problem(parallel: Any | None = None) -> str | None:
    """One line if the environment's value is not one of :data:`SPLIT_VALUES`, or asks for what
    ``parallel`` (the run's parallel section) would not do: ``1`` splits sequence parallelism's
    collectives, so it needs ``--sequence-parallel`` with tensor parallelism; ``copy-engine``
    carries tensor parallelism's (with or without sequence parallelism), so it needs
    ``--tensor-model-parallel-size > 1`` (checked before launch; nothing is silently left undone)."""
    value = split_value()
    if value not in SPLIT_VALUES:
        return f"{SPLIT_ENV}={value!r}: must be one of {', '.join(SPLIT_VALUES)}"
    if parallel is None or not split_chosen():
        return None
    tensor_parallel = parallel.tensor_model_parallel_size > 1
    if value == COPY_ENGINE and not tensor_parallel:
        return (
            f"{SPLIT_ENV}={value}: carries tensor parallelism's collectives, and this run has none"
            " (it needs --tensor-model-parallel-size > 1); unset it or set it to 0"
        )
    if value == "1" and not (tensor_parallel and parallel.sequence_parallel):
        return (
            f"{SPLIT_ENV}={value}: splits sequence parallelism's collectives, and this run has"
            " none (it needs --tensor-model-parallel-size > 1 and --sequence-parallel);"
            " unset it or set it to 0"
        )
    return None
