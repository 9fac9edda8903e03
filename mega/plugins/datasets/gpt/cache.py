"""The index cache: arrays saved under a key of everything they depend on, built by one process.

A cache entry ``{key}-{Class}-{split}`` is a set of ``.npy`` files, a ``description.json`` (the
inputs the key hashes, readable), and a ``complete`` marker. Every file is written under a
temporary name and renamed; the marker is written last, so an entry without it (a crash, a full
disk) is never read, only rebuilt. A ``.lock`` file beside the entry carries an exclusive
``fcntl.flock``: the first process to ask builds while the others block on the lock, then find the
marker and load. Loading memory-maps the arrays (``np.load(mmap_mode="r")``).

When the cache directory cannot be written (a read-only corpus and no ``--data-cache-path``), the
arrays are built in memory and not cached.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FINGERPRINT_BYTES = 1 << 20  # hashed from each end of an .idx file


def idx_fingerprint(path: str | Path) -> dict[str, Any]:
    """What identifies an ``.idx`` file's content cheaply: size, mtime and a hash of both ends.

    A rewritten dataset gets a new mtime (and usually size); the hashed head holds the counts and
    the first lengths, the tail the last document indices. Hashing the whole file would cost
    seconds per terabyte-scale corpus at every start.
    """
    stat = os.stat(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        if stat.st_size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, stat.st_size - FINGERPRINT_BYTES))
            digest.update(f.read())
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "blake2b": digest.hexdigest()}


def cache_key(description: dict[str, Any]) -> str:
    """The hex key of a description (sorted-key JSON, sha256, 32 hex digits)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class CachedArrays:
    """The arrays of one cache entry, and whether they were ``built``, ``loaded`` or ``uncached``."""

    def __init__(self, arrays: dict[str, np.ndarray], status: str, stem: Path | None):
        self.arrays = arrays
        self.status = status
        self.stem = stem

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


def _path(stem: Path, suffix: str) -> Path:
    return stem.with_name(f"{stem.name}-{suffix}")


def _write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load(stem: Path, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The entry's arrays if its marker exists and every file loads, else None."""
    if not _path(stem, "complete").is_file():
        return None
    arrays = {}
    try:
        for name in names:
            path = _path(stem, f"{name}.npy")
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    return arrays


def cached_arrays(
    directory: str | Path,
    stem_name: str,
    description: dict[str, Any],
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> CachedArrays:
    """Load entry ``{directory}/{stem_name}`` or build it (once, under the lock) and save it."""
    stem = Path(directory) / stem_name
    arrays = _load(stem, names)
    if arrays is not None:
        return CachedArrays(arrays, "loaded", stem)
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        lock = open(_path(stem, "lock"), "a+b")  # noqa: SIM115 - held across the build
    except OSError:
        return CachedArrays(build(), "uncached", None)
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        arrays = _load(stem, names)  # another process may have built it while we waited
        if arrays is not None:
            return CachedArrays(arrays, "loaded", stem)
        built = build()
        try:
            _save(stem, names, description, built)
        except OSError:  # a full or read-only disk: train from memory, leave no marker
            return CachedArrays(built, "uncached", None)
    return CachedArrays(built, "built", stem)


def _save(
    stem: Path, names: tuple[str, ...], description: dict[str, Any], arrays: dict[str, np.ndarray]
) -> None:
    _path(stem, "complete").unlink(missing_ok=True)
    for name in names:
        array = np.ascontiguousarray(arrays[name])
        _write_atomic(
            _path(stem, f"{name}.npy"), lambda f, a=array: np.save(f, a, allow_pickle=False)
        )
    text = json.dumps(description, indent=4, sort_keys=True, default=str).encode("utf-8")
    _write_atomic(_path(stem, "description.json"), lambda f: f.write(text))
    _fsync_directory(stem.parent)  # the arrays are durable before the marker names them whole
    _write_atomic(_path(stem, "complete"), lambda f: f.write(text))
    _fsync_directory(stem.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
