"""Name -> spec registries, filled by the ``register_*`` hooks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mega.core.errors import MegaUsageError, unknown_name_message

T = TypeVar("T")


class DuplicateNameError(Exception):
    """Two plugins registered the same name in one registry."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    spec: T
    provider: str  # the plugin (entry-point or module) name that registered it


class Registry(Generic[T]):
    """Specs of one kind (models, tokenizers, ...), keyed by ``spec.name``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def add(self, spec: T, provider: str) -> None:
        name = getattr(spec, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{provider} registered a {self.kind} without a name: {spec!r}")
        if name in self._entries:
            first = self._entries[name].provider
            raise DuplicateNameError(
                f"{self.kind} '{name}' is registered by two plugins: '{first}' and '{provider}'"
                " (block one with MEGA_BLOCK_PLUGINS)"
            )
        self._entries[name] = Entry(spec, provider)

    def get(self, name: str) -> T:
        """The spec called ``name``; unknown names list what exists and the closest match."""
        try:
            return self._entries[name].spec
        except KeyError:
            raise MegaUsageError(unknown_name_message(self.kind, name, self._entries)) from None

    def provider(self, name: str) -> str:
        return self._entries[name].provider

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, Entry[T]]]:
        return sorted(self._entries.items())


REGISTRY_HOOKS: dict[str, str] = {
    # registry kind -> the hook that fills it
    "model": "register_models",
    "tokenizer": "register_tokenizers",
    "dataset": "register_datasets",
    "parallel": "register_parallel",
    "checkpoint backend": "register_checkpoint_backends",
    "command": "register_commands",
}


def command_name(command: Any) -> str:
    """Commands are click objects; give them the ``name`` attribute registries key on."""
    return command.name
