"""Deprecated: moved to ``mega.core.training.engine`` (``Engine`` and ``StepResult`` are
``mega.Engine`` and ``mega.StepResult``)."""

from mega._deprecated import moved

__getattr__ = moved(__name__, "mega.core.training.engine", ["Engine", "StepResult", "CoreHooks"])
