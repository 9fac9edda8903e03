"""Moved to :mod:`mega.parallel.sharded` on 2026-11-27 (the parallel state below core builds them)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__, "mega.parallel.sharded", ["Piece", "ShardedTensor", "dtype_name"], since="2026-11-27"
)
