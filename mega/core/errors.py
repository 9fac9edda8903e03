"""Moved to :mod:`mega.errors` on 2026-11-27 (the parallel machinery below core raises them too)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.errors",
    [
        "MegaUsageError",
        "MegaRunError",
        "first_line",
        "edit_distance",
        "closest",
        "unknown_name_message",
    ],
    since="2026-11-27",
)
