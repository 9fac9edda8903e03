"""Checks on a run's layout that the model's plan cannot make (it never sees the sequence length).
No torch: called while validating the config, before any process group exists."""

from __future__ import annotations


def sequence_parallel_problems(seq_length: int, tp: int) -> list[str]:
    """Why ``--sequence-parallel`` cannot split ``seq_length`` over ``tp`` ranks (empty if it can)."""
    if tp > 1 and seq_length % tp:
        return [
            f"--seq-length ({seq_length}) must be divisible by --tensor-model-parallel-size "
            f"({tp}) with --sequence-parallel"
        ]
    return []
