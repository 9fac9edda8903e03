"""A plugin that opens every array of the ``zarr`` checkpoint backend in one tensorstore context
of this process, to measure context options before one becomes mega's default: load it with
``MEGA_PLUGINS_DIR=benchmarks/plugins`` and, e.g.,

    MEGA_TS_CONTEXT='{"file_io_concurrency": {"limit": 4}, "file_io_sync": false}'

(tensorstore's context resources: ``file_io_concurrency`` bounds the file operations in flight,
by default as many as the host has cores in every rank; ``file_io_sync`` is the fsync of each
chunk written). Rank 0 prints what it set.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mega import hookimpl

_SPEC = os.environ.get("MEGA_TS_CONTEXT")


class _OpenInContext:
    """tensorstore, with ``open`` given the one context."""

    def __init__(self, ts: Any, spec: dict) -> None:
        self._ts, self._context = ts, ts.Context(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ts, name)

    def open(self, *args: Any, **kwargs: Any) -> Any:
        return self._ts.open(*args, context=self._context, **kwargs)


if _SPEC:
    from mega.plugins.checkpoint import zarr_tensorstore

    _original, _proxy = zarr_tensorstore._ts, []

    def _ts() -> Any:
        if not _proxy:
            _proxy.append(_OpenInContext(_original(), json.loads(_SPEC)))
        return _proxy[0]

    zarr_tensorstore._ts = _ts


@hookimpl
def topology_ready(topology: Any) -> None:
    if _SPEC and topology.rank == 0:
        print(f"tensorstore_context: {_SPEC}", flush=True)
