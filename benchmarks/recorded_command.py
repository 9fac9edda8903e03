"""A recorded ``mega train`` command (a result file's ``command``: ``python -m mega train ...`` or
``fake_rank.py train ...``) as the flags ``mega plan`` takes for the same run."""

from __future__ import annotations

import shlex

# the flags that belong to the run, not to what it trains (and a plan needs none of)
RUN_ONLY = ("--nproc-per-node", "--run-dir", "--train-iters", "--log-interval", "--master-port")


def without_run_flags(words: list[str]) -> list[str]:
    """``words`` without :data:`RUN_ONLY`'s flags and their values."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in RUN_ONLY:
            skip = True
        else:
            kept.append(word)
    return kept


def plan_argv(command: str, world_size: int) -> list[str]:
    """The plan's arguments for the run of ``command`` on ``world_size`` GPUs."""
    words = shlex.split(command)
    words = without_run_flags(words[words.index("train") + 1 :])
    return [*words, "--nproc-per-node", str(world_size), "--device", "cuda"]
