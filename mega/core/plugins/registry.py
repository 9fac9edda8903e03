"""Name -> spec registries, filled by the ``register_*`` hooks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from mega.errors import MegaUsageError, unknown_name_message

T = TypeVar("T")


class DuplicateNameError(Exception):
    """Two plugins registered the same name in one registry."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    spec: T
    provider: str  # the plugin (entry-point or module) name that registered it


class Registry(Generic[T]):
    """Specs of one kind (models, tokenizers, ...), keyed by ``spec.name``.

    A name two plugins registered is a clash: the first provider's entry stays listed, but
    ``get`` refuses the name (naming both plugins), so a command that uses that very name stops
    and one that does not is unaffected (docs/plugins.md section 7)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self.clashes: dict[str, str] = {}  # name -> the message naming both providers

    def add(self, spec: T, provider: str) -> None:
        name = getattr(spec, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{provider} registered a {self.kind} without a name: {spec!r}")
        if name in self._entries:
            first = self._entries[name].provider
            message = (
                f"{self.kind} '{name}' is registered by two plugins: '{first}' and '{provider}'"
                " (block one with MEGA_BLOCK_PLUGINS)"
            )
            self.clashes.setdefault(name, message)
            raise DuplicateNameError(message)
        self._entries[name] = Entry(spec, provider)

    def check_name(self, name: str) -> None:
        """Raise ``MegaUsageError`` if two plugins registered ``name``."""
        if name in self.clashes:
            raise MegaUsageError(self.clashes[name])

    def get(self, name: str) -> T:
        """The spec called ``name``; unknown names list what exists and the closest match, and a
        name two plugins registered is refused (naming both)."""
        self.check_name(name)
        try:
            return self._entries[name].spec
        except KeyError:
            raise MegaUsageError(unknown_name_message(self.kind, name, self._entries)) from None

    def peek(self, name: str) -> T:
        """The first provider's spec even if the name clashes: for listings, never for use."""
        return self._entries[name].spec

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
    "checkpoint backend": "register_checkpoint_backends",
    "checkpoint converter": "register_checkpoint_converters",
    "optimizer": "register_optimizers",
    "command": "register_commands",
}

# One hook fills every parallel choice's registry: each spec's class names its kind
# (``choice_kind``), so a new kind of choice needs no entry here.
CHOICES_HOOK = "register_parallel_choices"
# The kinds mega's own code looks up (present even when no plugin registered one)
BUILTIN_CHOICE_KINDS = ("parallel", "moe dispatcher", "cp comm type")
# The hooks each of those had before; still called for a release, with a DeprecationWarning
DEPRECATED_CHOICE_HOOKS: dict[str, str] = {
    "register_parallel": "parallel",
    "register_moe_dispatchers": "moe dispatcher",
    "register_cp_comm_types": "cp comm type",
}
