"""A run's configuration: option fields, flags, sections, resolving and validating them.

This package was the module ``mega.core.config`` until 2026-11-23: its names, now in
``mega.core.config.sections``, still answer here with a ``DeprecationWarning``.
"""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.core.config.sections",
    [
        "RunConfig",
        "TrainingConfig",
        "OptimizerConfig",
        "SchedulerConfig",
        "PrecisionConfig",
        "CheckpointConfig",
        "LoggingConfig",
        "DataConfig",
        "ParallelConfig",
        "LaunchConfig",
        "CORE_SECTIONS",
        "PLUGIN_SECTIONS",
    ],
)
