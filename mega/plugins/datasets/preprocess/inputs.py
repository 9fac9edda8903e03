"""JSONL input: ``--input`` files and globs, plain or gzip, read as chunks of whole lines.

The parent process never holds more than one chunk of raw bytes per worker in flight: a chunk is
``chunk_bytes`` (a few MB) of complete lines, cut at the last newline, with the 1-based number of
its first line so that a worker can name ``file:line`` in an error. A chunk never spans two files.
JSON strings cannot contain a raw newline, so cutting at ``\\n`` never splits a record.
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mega.errors import MegaUsageError

GZIP_MAGIC = b"\x1f\x8b"
GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class Chunk:
    """Whole lines of one input file, sent to a worker as raw bytes."""

    file_index: int
    first_line: int  # 1-based line number of the first line in ``data``
    data: bytes
    disk_bytes: int  # bytes of the file on disk consumed since the previous chunk (progress)


def expand_inputs(patterns: list[str]) -> list[str]:
    """``--input`` values as a list of files, each glob expanded in sorted order.

    A glob that matches nothing, a missing file or a directory is a usage error naming it.
    """
    files: list[str] = []
    for pattern in patterns:
        if GLOB_CHARS & set(pattern):
            matches = sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
            if not matches:
                raise MegaUsageError(f"--input {pattern}: matches no files")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise MegaUsageError(
                f"--input {pattern}: is a directory (use a glob: {pattern}/*.jsonl)"
            )
        elif not os.path.isfile(pattern):
            raise MegaUsageError(f"--input {pattern}: no such file")
        else:
            files.append(pattern)
    return files


def is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def read_chunks(files: list[str], chunk_bytes: int, first_index: int = 0) -> Iterator[Chunk]:
    """Every file's lines, in order, as chunks of about ``chunk_bytes`` (never splitting a line).

    ``first_index`` numbers the files (``Chunk.file_index``) when ``files`` is a slice of the
    whole input list. A file that cannot be read, or corrupt gzip data, is a usage error.
    """
    for offset, path in enumerate(files):
        try:
            yield from _file_chunks(path, first_index + offset, chunk_bytes)
        except (OSError, EOFError, zlib.error) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise MegaUsageError(f"{path}: cannot read: {reason}") from None


def _file_chunks(path: str, index: int, chunk_bytes: int) -> Iterator[Chunk]:
    raw = open(path, "rb")
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip(path) else raw
    with raw, stream:
        line = 1
        # Blocks of a line not yet ended. A line longer than a chunk spans several blocks; they
        # are joined once when it ends (re-joining on every block would be quadratic).
        pending: list[bytes] = []
        disk_seen = 0
        while True:
            block = stream.read(chunk_bytes)
            if not block:
                break
            cut = block.rfind(b"\n") + 1  # only the new block can hold the line's end
            if cut == 0:
                pending.append(block)
                continue
            chunk = b"".join([*pending, block[:cut]]) if pending else block[:cut]
            pending = [block[cut:]] if cut < len(block) else []
            disk = raw.tell()
            yield Chunk(index, line, chunk, disk - disk_seen)
            disk_seen = disk
            line += chunk.count(b"\n")
        disk = os.fstat(raw.fileno()).st_size
        if pending:  # a last line without a newline
            yield Chunk(index, line, b"".join(pending), disk - disk_seen)
        elif disk > disk_seen:
            yield Chunk(index, line, b"", disk - disk_seen)


def total_disk_bytes(files: list[str]) -> int:
    return sum(Path(f).stat().st_size for f in files)
