"""A zarr save is durable before it is marked complete, with one flush of the file system instead
of an fsync per file (tensorstore's default, about four per array: a save of the 1.3B GPT's
~1,200 arrays committed the journal ~4,700 times)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mega.core.checkpoint.sharded_store import start_sharded_save
from mega.core.checkpoint.store import MARKER, flush_filesystem
from mega.core.plugins.manager import make_plugins
from mega.parallel.sharded import Piece, ShardedTensor
from mega.plugins.checkpoint import zarr_tensorstore


def _tensors(count: int) -> list[ShardedTensor]:
    return [
        ShardedTensor(
            f"model/w{i}", (4, 6), torch.float32, [Piece((0, 0), torch.full((4, 6), float(i)))]
        )
        for i in range(count)
    ]


def _save(directory: Path, count: int) -> Path:
    backend = make_plugins().checkpoint_backends.get("zarr")
    return start_sharded_save(directory, 1, _tensors(count), {}, {}, backend).finish()


def test_the_save_flushes_its_files_once_after_they_are_written_and_before_the_marker(
    tmp_path, monkeypatch
):
    seen = []

    def recording_flush(path: Path) -> None:
        chunks = sorted(p.relative_to(path).as_posix() for p in path.rglob("c/*"))
        seen.append((path, (path / MARKER).exists(), chunks))
        flush_filesystem(path)

    monkeypatch.setattr(zarr_tensorstore, "flush_filesystem", recording_flush)
    final = _save(tmp_path / "iter_0000001", 3)
    assert len(seen) == 1
    path, marked, chunks = seen[0]
    assert path.name == ".iter_0000001.tmp" and not marked  # written, not yet complete
    assert chunks == [f"model/w{i}/c/0" for i in range(3)]
    assert (final / MARKER).exists()


def test_flush_filesystem_on_a_directory_returns_and_on_nothing_names_it(tmp_path):
    flush_filesystem(tmp_path)
    with pytest.raises(FileNotFoundError):
        flush_filesystem(tmp_path / "missing")


_SAVE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_checkpoint_durability import _save
_save(Path(sys.argv[1]), int(sys.argv[2]))
"""


def _syscalls(tmp_path: Path, count: int) -> dict[str, int]:
    """The fsync-like system calls of one process saving ``count`` arrays (strace -c)."""
    script = _SAVE.format(tests=str(Path(__file__).parent))
    target = tmp_path / f"n{count}" / "iter_0000001"
    command = ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync,syncfs,sync"]
    command += [sys.executable, "-c", script, str(target), str(count)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = dict.fromkeys(("fsync", "fdatasync", "syncfs", "sync"), 0)
    for line in result.stderr.splitlines():
        # % time, seconds, usecs/call, calls, [errors,] syscall
        fields = line.split()
        if len(fields) in (5, 6) and fields[-1] in calls and re.fullmatch(r"[\d.]+", fields[0]):
            calls[fields[-1]] = int(fields[3])
    return calls


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_the_fsyncs_of_a_save_do_not_grow_with_its_arrays(tmp_path):
    few, many = _syscalls(tmp_path, 4), _syscalls(tmp_path, 24)
    assert few["syncfs"] == many["syncfs"] == 1
    # the marker, the metadata, the zarr groups and the directory rename: a fixed few
    assert many["fsync"] == few["fsync"] < 10, (few, many)
