"""Deprecated: moved to ``mega.core.training.init`` (``normal_`` is ``mega.normal_``)."""

from mega._deprecated import moved

__getattr__ = moved(__name__, "mega.core.training.init", ["normal_", "param_seed"])
