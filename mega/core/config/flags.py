"""Megatron-style flags generated from config dataclasses, and a parser that names what is wrong.

Each field of each section becomes one flag; ``FlagTable.parse`` turns ``argv`` into
``{section: {field: value}}`` and collects every problem (unknown flag, missing value, bad
number, bad choice) instead of stopping at the first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mega.core.config.fields import default_of, field_type
from mega.errors import closest


@dataclass(frozen=True)
class Flag:
    """One config field as the command line and config files see it."""

    section: str
    name: str  # the field name, also the config-file key
    cls: type
    base_type: type  # int, float, str, bool or list
    optional: bool
    help: str
    choices: tuple[Any, ...] | None
    switch_value: bool | None  # for booleans: the value the flag sets
    nargs: str | None

    @property
    def flags(self) -> list[str]:
        return list(self._names())

    def _names(self) -> list[str]:
        field = self.cls.__dataclass_fields__[self.name]
        custom = field.metadata.get("flag")
        names = [custom] if custom else ["--" + self.name.replace("_", "-")]
        return names + list(field.metadata.get("aliases", ()))

    @property
    def default(self) -> Any:
        return default_of(self.cls.__dataclass_fields__[self.name])

    def convert(self, value: Any) -> Any:
        """A raw flag or file value as this field's type; raises ValueError with a reason."""
        if value is None and self.optional:
            return None
        if self.base_type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            raise ValueError(f"expected true or false, got {value!r}")
        if self.base_type is list:
            items = value if isinstance(value, list | tuple) else str(value).split()
            return [str(item) for item in items]
        if self.base_type is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            try:
                converted = int(float(value)) if isinstance(value, float) else int(value)
            except (TypeError, ValueError):
                raise ValueError(f"expected an integer, got {value!r}") from None
        elif self.base_type is float:
            try:
                converted = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"expected a number, got {value!r}") from None
        else:
            converted = str(value)
        if self.choices and converted not in self.choices:
            raise ValueError(f"expected one of {', '.join(map(str, self.choices))}, got {value!r}")
        return converted


class FlagTable:
    """Every flag of a set of sections. Two sections defining the same field name is an error."""

    def __init__(self, sections: dict[str, type], owners: dict[str, str] | None = None):
        self.by_flag: dict[str, Flag] = {}
        self.by_key: dict[str, Flag] = {}
        self.conflicts: list[str] = []
        owners = owners or {}
        for section, cls in sections.items():
            for field in dataclasses.fields(cls):
                base, optional = field_type(cls, field)
                meta = field.metadata
                store = meta.get("store")
                switch = (True if store is None else store) if base is bool else None
                flag = Flag(
                    section, field.name, cls, base, optional, meta.get("help", ""),
                    meta.get("choices"), switch, meta.get("nargs"),
                )  # fmt: skip
                if field.name in self.by_key:
                    other = self.by_key[field.name].section
                    self.conflicts.append(
                        f"option '{field.name}' is defined by both {owners.get(other, other)}"
                        f" and {owners.get(section, section)}"
                    )
                    continue
                self.by_key[field.name] = flag
                for name in flag.flags:
                    self.by_flag[name] = flag
                if base is bool and switch is True and default_of(field) is not False:
                    # a default-on (or decided-later, None) switch needs a way off: --no-<name>
                    self.by_flag["--no-" + field.name.replace("_", "-")] = flag

    def parse(self, argv: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """``argv`` -> ({section: {field: value}}, errors). Later flags override earlier ones."""
        values: dict[str, dict[str, Any]] = {}
        errors: list[str] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if not token.startswith("--"):
                errors.append(f"unexpected argument '{token}' (flags start with --)")
                continue
            name, eq, inline = token.partition("=")
            flag = self.by_flag.get(name)
            if flag is None:
                hint = closest(name, self.by_flag)
                errors.append(f"unknown flag {name}" + (f" (did you mean {hint}?)" if hint else ""))
                # skip the unknown flag's values so they are not reported as strays
                while i < len(argv) and not argv[i].startswith("--"):
                    i += 1
                continue
            inverted = flag.base_type is bool and (name not in flag.flags or not flag.switch_value)
            if flag.base_type is bool and not eq:
                # the generated --no-<name> form turns a default-on switch off
                value: Any = not inverted
            elif flag.base_type is bool:
                # --disable-bias-linear=true means "disable": negate for inverted switches
                try:
                    value = flag.convert(inline) != inverted
                except ValueError as exc:
                    errors.append(f"flag {name}: {exc}")
                    continue
            elif eq:
                value = inline.split() if flag.base_type is list else inline
            else:
                taken = []
                while i < len(argv) and not (argv[i].startswith("--") and len(argv[i]) > 2):
                    taken.append(argv[i])
                    i += 1
                    if flag.base_type is not list:
                        break
                if not taken:
                    errors.append(f"flag {name} needs a value")
                    continue
                value = taken if flag.base_type is list else taken[0]
            try:
                values.setdefault(flag.section, {})[flag.name] = flag.convert(value)
            except ValueError as exc:
                errors.append(f"flag {name}: {exc}")
        return values, errors
