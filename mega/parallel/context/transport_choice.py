"""Which transport the p2p ring's lanes use (:mod:`.lanes`), chosen by an environment variable:
``nccl`` (the default) or ``copy-engine``; and whether the ring's passes replay as CUDA graphs
(:mod:`.graphed`). Torch-free, so the check before launch stays light."""

from __future__ import annotations

import os

TRANSPORT_ENV = "MEGA_CP_P2P_TRANSPORT"
TRANSPORTS = ("nccl", "copy-engine")  # the first is the default
GRAPHS_ENV = "MEGA_CP_RING_GRAPHS"
GRAPHS_CHOICES = ("0", "1")  # the first is the default


def chosen_transport() -> str:
    """The transport the environment names (checked before launch by :mod:`.validate`)."""
    return os.environ.get(TRANSPORT_ENV, TRANSPORTS[0])


def transport_problem() -> str | None:
    """One line saying what is wrong with the environment's choice, or None."""
    choice = chosen_transport()
    if choice in TRANSPORTS:
        return None
    return f"{TRANSPORT_ENV}={choice!r}: must be one of {', '.join(TRANSPORTS)}"


def _graphs_choice() -> str:
    return os.environ.get(GRAPHS_ENV, GRAPHS_CHOICES[0])


def graphs_chosen() -> bool:
    """Whether the environment asks for the ring's passes as CUDA graphs."""
    return _graphs_choice() == "1"


def graphs_problem(comm_type: str) -> str | None:
    """One line saying why the ring's CUDA graphs cannot be what the environment asks, or None,
    whatever the machine (that the run has GPUs is ``mega.core.config.run_checks``' check, which
    ``mega plan`` skips: it plans for another machine's)."""
    choice = _graphs_choice()
    if choice not in GRAPHS_CHOICES:
        return f"{GRAPHS_ENV}={choice!r}: must be 0 or 1"
    if choice == "0":
        return None
    if comm_type != "p2p":
        return f"{GRAPHS_ENV}=1 graphs the p2p ring; --cp-comm-type is {comm_type!r}"
    if chosen_transport() != TRANSPORTS[0]:
        return (
            f"{GRAPHS_ENV}=1 needs {TRANSPORT_ENV}=nccl (a copy lane's inbox grows by a rendezvous)"
        )
    return None
