"""Which transport the p2p ring's lanes use (:mod:`.lanes`), chosen by an environment variable:
``nccl`` (the default) or ``copy-engine``. Torch-free, so the check before launch stays light."""

from __future__ import annotations

import os

TRANSPORT_ENV = "MEGA_CP_P2P_TRANSPORT"
TRANSPORTS = ("nccl", "copy-engine")  # the first is the default


def chosen_transport() -> str:
    """The transport the environment names (checked before launch by :mod:`.validate`)."""
    return os.environ.get(TRANSPORT_ENV, TRANSPORTS[0])


def transport_problem() -> str | None:
    """One line saying what is wrong with the environment's choice, or None."""
    choice = chosen_transport()
    if choice in TRANSPORTS:
        return None
    return f"{TRANSPORT_ENV}={choice!r}: must be one of {', '.join(TRANSPORTS)}"
