"""Deprecated: moved to ``mega.core.config.fields`` (``option`` is ``mega.option``)."""

from mega._deprecated import moved

__getattr__ = moved(__name__, "mega.core.config.fields", ["option", "field_type", "default_of"])
