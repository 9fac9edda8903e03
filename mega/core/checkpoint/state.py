"""Deprecated: the run's state in a checkpoint (what the engine saves and restores) moved to
``mega.core.training.run_state`` (2026-11-29), with the training code that owns it."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.core.training.run_state",
    [
        "FORMAT",
        "common_state",
        "training_state",
        "rank_rng_state",
        "restore_rank_rng",
        "fp8_scaling_state",
        "restore_fp8_scaling",
        "model_without_padding",
        "model_with_padding",
        "layout_of",
        "sharded_tensors",
        "cpu_threads",
        "restore_training_state",
        "model_flags_hint",
        "save_run",
        "prepare_async_save",
        "finish_pending_save",
        "load_run",
    ],
    since="2026-11-29",
)
