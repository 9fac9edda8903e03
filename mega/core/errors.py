"""Errors that end a command with a one-line message and exit code 2 (bad input, not a bug)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MegaUsageError(Exception):
    """Bad input from the user: shown as one ``error:`` line per message, exit code 2."""

    def __init__(self, messages: str | list[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("; ".join(self.messages))


class MegaRunError(Exception):
    """A run that cannot go on (e.g. NaN gradients): one ``error:`` line, exit code 1."""


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The most similar choice to ``name``, or None when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[match[0]] if match else None


def unknown_name_message(kind: str, name: str, choices: Iterable[str]) -> str:
    """``unknown model 'gtp' (available: bert, gpt; did you mean 'gpt'?)``."""
    choices = sorted(choices)
    hint = closest(name, choices)
    suggestion = f"; did you mean '{hint}'?" if hint else ""
    available = ", ".join(choices) if choices else "none"
    return f"unknown {kind} '{name}' (available: {available}{suggestion})"
