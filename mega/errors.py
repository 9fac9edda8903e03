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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none): how a
    library's multi-line error becomes part of one ``error:`` line."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions (``gtp`` -> ``gpt`` is 1)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, previous2[j - 2] + 1)
            current.append(cost)
        previous2, previous = previous, current
    return previous[-1]


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice ``name`` is most likely a typo of, or None when nothing is close.

    Close means a few edits apart for the name's length (a third of its letters, at least one),
    ignoring case and leading dashes, or the name being a prefix of the choice: ``--num-layer``
    -> ``--num-layers``, ``gtp`` -> ``gpt``, but never ``--wandb-project`` -> ``--adam-beta2``.
    """
    key = name.lower().lstrip("-")
    best: tuple[int, float, str] | None = None
    for choice in choices:
        other = choice.lower().lstrip("-")
        if not key or not other:
            continue
        distance, allowed = edit_distance(key, other), max(1, len(key) // 3)
        if distance > allowed and not (len(key) >= 4 and other.startswith(key)):
            continue
        ratio = difflib.SequenceMatcher(None, key, other).ratio()
        rank = (min(distance, allowed + 1), -ratio, choice)  # typos first, then prefixes
        if best is None or rank < best:
            best = rank
    return best[2] if best else None


def unknown_name_message(kind: str, name: str, choices: Iterable[str]) -> str:
    """``unknown model 'gtp' (available: bert, gpt; did you mean 'gpt'?)``."""
    choices = sorted(choices)
    hint = closest(name, choices)
    suggestion = f"; did you mean '{hint}'?" if hint else ""
    available = ", ".join(choices) if choices else "none"
    return f"unknown {kind} '{name}' (available: {available}{suggestion})"
