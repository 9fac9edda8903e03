"""How a config dataclass field becomes a command-line flag and a config-file key.

A field ``num_layers`` is the flag ``--num-layers`` and the file key ``num_layers``. Metadata
refines it (all optional)::

    num_layers: int = option(4, "Number of transformer layers.")
    normalization: str = option("LayerNorm", "Norm type.", choices=("LayerNorm", "RMSNorm"))
    add_bias_linear: bool = option(True, "...", flag="--disable-bias-linear", store=False)
    data_path: list[str] = option([], "...", nargs="+")
    nproc_per_node: int = option(1, "...", aliases=("--nproc_per_node",))

Booleans are switches: ``--swiglu`` sets True. A boolean that defaults to True gets ``--no-<name>``
unless ``flag`` says otherwise. ``aliases`` are further spellings of the same flag (old Megatron
names, torchrun's underscores); they parse exactly as the main one. A config class may define ``validate(self) -> list[str]``; its
messages are collected with every other validation error before anything starts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    flag: str | None = None,
    store: bool | None = None,
    nargs: str | None = None,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field with the metadata the flag parser reads. Mutable defaults are copied."""
    metadata = {"help": help, "choices": choices, "flag": flag, "store": store, "nargs": nargs}
    metadata["metavar"] = metavar
    metadata["aliases"] = tuple(aliases)
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_type(cls: type, field: dataclasses.Field) -> tuple[type, bool]:
    """(base type, optional?) of a field, resolving string annotations (``from __future__``)."""
    hints = typing.get_type_hints(cls)
    tp = hints[field.name]
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
        origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return list, optional
    return tp, optional


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None
