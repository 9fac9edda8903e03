"""Deprecated: moved to ``mega.parallel.topology``."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.parallel.topology",
    [
        "Topology",
        "build_topology",
        "group_ranks",
        "ORDER",
    ],
)
