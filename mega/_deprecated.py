"""Old import paths kept working: a module ``__getattr__`` that hands out a moved name from its
new home with a ``DeprecationWarning`` naming that home (see "Deprecated" in docs/changelog.md).

An old module becomes a shim of two lines (no torch until a name is used)::

    from mega._deprecated import moved

    __getattr__ = moved(__name__, "mega.core.config.fields", ["option", "field_type"])

The warning points at the line that used the old path. Only the names listed are forwarded: an
old package's ``__getattr__`` must not answer for its own submodules. A module whose names went
to several homes uses ``moved_apart(__name__, {home: names, ...})``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any


def moved(old: str, new: str, names: Iterable[str], since: str = "2026-11-23") -> Callable:
    """``__getattr__`` for module ``old``, whose ``names`` moved to module ``new`` on ``since``."""
    return moved_apart(old, {new: names}, since)


def moved_apart(old: str, homes: dict[str, Iterable[str]], since: str = "2026-11-23") -> Callable:
    """``__getattr__`` for module ``old``, whose names moved on ``since`` to several modules:
    ``homes`` maps each new module to the names it took."""
    home_of = {name: new for new, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        new = home_of.get(name)
        if new is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)
        # ``from package import name`` first asks hasattr() from inside the import system, then
        # getattr() from the importing line: warn once, for that line.
        if not sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):
            warnings.warn(
                f"{old}.{name} is deprecated since {since}: use {new_path(new, name)}",
                DeprecationWarning,
                stacklevel=2,
            )
        return value

    return __getattr__


def new_path(module: str, name: str) -> str:
    """Where to import ``name`` from now: the package face ``mega`` when it exports it."""
    face = sys.modules["mega"]  # imported before any of its submodules, this one included
    return f"'from {'mega' if name in face.__all__ else module} import {name}'"
