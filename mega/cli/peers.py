"""A rank of a multi-process job whose collective broke because another rank went away: how to
tell, and how long to hold its own message back so that the rank that failed first is blamed.
Used by ``mega.cli.main`` for every command, launched by ``mega train --nproc-per-node`` or not."""

from __future__ import annotations

import sys
import time

# A rank whose peer vanished waits this long before it reports: the launcher that started it is,
# meanwhile, noticing the rank that died first and stopping this one, so that rank is blamed.
PEER_LOST_GRACE_S = 3.0


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store of a multi-process job failing because another
    rank went away (or timed out): gloo's "Connection closed by peer", NCCL's and the store's
    ``DistError``s."""
    # never imported here: mega --help stays fast. Not "is the group initialised": mega train
    # has already destroyed it (leave_job) by the time main() sees the error.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "Connection closed by peer" in text or "Connection reset by peer" in text
    )


def wait_for_launcher() -> None:
    """Give the launcher time to see the rank that failed first (and stop this one) before this
    rank reports its own, secondary, failure; see ``PEER_LOST_GRACE_S``."""
    time.sleep(PEER_LOST_GRACE_S)
