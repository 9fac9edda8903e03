"""Deprecated: moved to ``mega.parallel.plan`` (``ParallelPlan`` is ``mega.ParallelPlan``)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.parallel.plan",
    [
        "ParallelPlan",
        "COLUMN",
        "ROW",
        "VOCAB_EMBEDDING",
        "SEQUENCE_SCATTER",
        "LM_HEAD",
    ],
)
