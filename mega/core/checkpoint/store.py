"""Checkpoint directories, completion markers and the ``latest`` tracker; backends write the files.

Layout (Megatron's names): ``<save>/iter_0000100/`` holds the backend's files plus
``complete.json``, and ``<save>/latest_checkpointed_iteration.txt`` names the newest one.

A save writes into ``<save>/.iter_0000100.tmp``, fsyncs every file, writes the marker (with each
file's sha256) last, renames the directory into place, and only then updates the tracker. A crash
at any point leaves either the previous checkpoint or a hidden temp directory, never a directory
that looks complete. Loading verifies the checksums, so a truncated or altered file is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mega.errors import MegaUsageError

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "complete.json"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_in_place(tmp: Path, final: Path) -> None:
    """Rename the finished directory ``tmp`` to ``final`` (replacing an older one of that name)
    and make the rename durable."""
    if final.exists():  # re-saving an iteration: move the old one aside before replacing it
        old = final.parent / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(final.parent)


def write_tracker(root: Path, iteration: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (after it is in place)."""
    atomic_write_text(Path(root) / TRACKER, f"{iteration}\n")


def save_checkpoint(root: str | Path, iteration: int, state: dict[str, Any], backend: Any) -> Path:
    """Write one complete checkpoint through ``backend`` (a CheckpointBackendSpec)."""
    root = Path(root)
    final = iteration_dir(root, iteration)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a previous crash's leftovers
    tmp.mkdir(parents=True)
    files = backend.save(tmp, state)
    checksums = {}
    for name in files:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
        checksums[name] = _sha256(tmp / name)
    marker = {"iteration": iteration, "backend": backend.name, "files": checksums}
    if isinstance(state.get("config"), dict):  # read by --use-checkpoint-args without torch
        marker["config"] = state["config"]
    atomic_write_text(tmp / MARKER, json.dumps(marker, indent=1))  # the marker goes last
    put_in_place(tmp, final)
    write_tracker(root, iteration)
    return final


def _complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint ``--load`` means: an ``iter_*`` directory itself, or a save root's latest."""
    path = Path(path)
    if _complete(path):
        return path
    tracker = path / TRACKER
    if tracker.is_file():
        try:
            candidate = iteration_dir(path, int(tracker.read_text().strip()))
        except ValueError:
            candidate = None
        if candidate is not None and _complete(candidate):
            return candidate
    complete = sorted(d for d in path.glob("iter_*") if _complete(d))
    return complete[-1] if complete else None


def peek_marker(path: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(directory, marker) of the checkpoint ``path`` names, or None when there is none or its
    marker is unreadable (for telling formats apart; loading reports what is wrong)."""
    directory = find_checkpoint(path)
    if directory is None:
        return None
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return (directory, marker) if isinstance(marker, dict) else None


def unwritable_reason(path: Path) -> str | None:
    """Why ``path`` could not become a writable directory, without creating anything."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if existing == path:
        try:
            with tempfile.TemporaryFile(dir=path):
                return None
        except OSError as exc:
            return exc.strerror or str(exc)
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot create directories in {existing}"
    # os.access says yes to root in /proc and /sys, where mkdir still fails: try one, remove it
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".mega-probe-"))
    except OSError as exc:
        return f"cannot create directories in {existing}: {exc.strerror or exc}"
    return None


def validate_checkpoint_dirs(cfg: Any) -> list[str]:
    """Problems with ``--save`` and ``--load``, found before anything starts."""
    errors = []
    if cfg.save:
        problem = unwritable_reason(Path(cfg.save))
        if problem:
            errors.append(f"--save {cfg.save}: not a writable directory ({problem})")
    if cfg.load:
        load = Path(cfg.load)
        fresh_auto_resume = cfg.save and load.resolve() == Path(cfg.save).resolve()
        if not load.exists() and not fresh_auto_resume:
            errors.append(f"--load {cfg.load}: no such directory")
        elif load.exists() and find_checkpoint(load) is None and not fresh_auto_resume:
            errors.append(f"--load {cfg.load}: no complete checkpoint there (no {MARKER} marker)")
    return errors


def read_marker(path: str | Path, backends: Any) -> tuple[Path, dict[str, Any], Any]:
    """(directory, its marker, its backend) of the checkpoint ``--load`` names."""
    directory = find_checkpoint(path)
    if directory is None:
        raise MegaUsageError(f"--load {path}: no complete checkpoint there")
    try:
        marker = json.loads((directory / MARKER).read_text())
        marker["files"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MegaUsageError(f"--load {directory}: unreadable {MARKER} ({exc})") from None
    name = marker.get("backend")
    if name not in backends:
        raise MegaUsageError(
            f"--load {directory}: written by checkpoint backend {name!r}, which is not installed"
        )
    return directory, marker, backends.get(name)


def verify_files(directory: Path, marker: dict[str, Any]) -> None:
    """Every file the marker lists is there with its sha256 (not truncated, not altered)."""
    for name, expected in marker["files"].items():
        file = directory / name
        if not file.is_file() or _sha256(file) != expected:
            raise MegaUsageError(f"--load {directory}: {name} is missing or corrupt (checksum)")


def load_checkpoint(path: str | Path, backends: Any) -> tuple[Path, dict[str, Any]]:
    """Read the whole-state checkpoint ``--load`` names, verifying every file against its
    marker."""
    directory, marker, backend = read_marker(path, backends)
    verify_files(directory, marker)
    try:
        return directory, backend.load(directory)
    except Exception as exc:
        raise MegaUsageError(
            f"--load {directory}: cannot read it ({type(exc).__name__}: {exc})"
        ) from None


def unpadded_model(state: dict[str, Any], where: Any) -> dict[str, Any]:
    """The model tensors of a whole-state checkpoint (``where``: its directory, for the error),
    vocabulary-sized ones without padding rows; one written by an older mega kept those rows
    and is refused."""
    if not state.get("vocab_unpadded"):
        raise MegaUsageError(
            f"{where}: written by an older mega that kept the vocabulary's padding rows; load it"
            " with mega train and save it again"
        )
    return state["model"]
