"""Converting a model's weights from one checkpoint format to another, one tensor at a time.

SRC's format is the one whose ``detect`` accepts it (or the one named); its reader gives a
``ModelWeights``, the target format's writer writes it into a hidden sibling of DST that is
renamed to DST only when complete, so a failure or a crash never leaves a DST that looks whole.
``read_options`` are hints for the reader (``true_vocab_size``), passed as keyword arguments of
its ``read``; one the reader does not take is an error, not silently dropped.

No source tensor is left out without a word: a reader returns the checkpoint's tensors as a
``SourceTensors`` (``ModelWeights.source``) that recorded which it took and which it set aside
with a reason. Before anything is written, a tensor neither taken nor set aside is a one-line
error naming it; after writing, so is one that was taken but never read (a reader or writer
that dropped it). A reader that gives no account is refused, so a new one cannot forget it.
"""

from __future__ import annotations

import inspect
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mega.core.convert.weights import LazyTensor, ModelWeights, SourceTensors
from mega.errors import MegaRunError, MegaUsageError


@dataclass
class ConversionReport:
    source_format: str
    target_format: str
    tensors: int
    bytes: int
    seconds: float
    ignored: dict[str, str] = field(default_factory=dict)  # source tensor -> why it is not used
    notes: list[str] = field(default_factory=list)  # what the writer says it wrote (one line each)


def source_format(src: Path, converters: Any, named: str | None) -> Any:
    """The converter that reads ``src``: the one named, or the first that detects it."""
    if named is not None:
        spec = converters.get(named)
        if spec.read is None:
            raise MegaUsageError(f"--from {named}: mega can only write this format")
        return spec
    readers = [converters.get(name) for name in converters if converters.get(name).read]
    for spec in readers:
        if spec.detect(src):
            return spec
    known = "; ".join(f"{s.name}: {s.description}" for s in readers)
    raise MegaUsageError(f"{src}: not a checkpoint of any known format ({known})")


def _read(reader: Any, src: Path, options: dict[str, Any]) -> ModelWeights:
    """``reader.read(src, **options)``; an option it does not take is a one-line error."""
    given = {name: value for name, value in options.items() if value is not None}
    if given:
        parameters = inspect.signature(reader.read).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        for name in given:
            if not takes_any and name not in parameters:
                flag = "--" + name.replace("_", "-")
                raise MegaUsageError(f"{flag}: the {reader.name} format does not take it")
    return reader.read(src, **given)


def _counted(weights: ModelWeights, progress: Callable[[str, int], None]) -> ModelWeights:
    """The same weights, calling ``progress(name, bytes)`` as each tensor is loaded."""

    def wrap(name: str, t: LazyTensor) -> LazyTensor:
        def load() -> Any:
            values = t.load()
            progress(name, t.nbytes)
            return values

        return LazyTensor(t.shape, t.dtype, load)

    return replace(weights, tensors={name: wrap(name, t) for name, t in weights.tensors.items()})


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _accounted(reader: str, weights: ModelWeights) -> SourceTensors:
    """The reader's account of the source tensors; a tensor it neither used nor set aside by
    name is a one-line error (converting would drop it silently)."""
    source = weights.source
    if not isinstance(source, SourceTensors):
        raise MegaUsageError(
            f"the {reader} format's reader gives no account of the tensors it read"
            " (ModelWeights.source), so mega cannot tell that none is left out"
        )
    unused = source.unaccounted()
    if unused:
        raise MegaUsageError(
            f"{source.where}: the {reader} reader does not use {len(unused)} of its tensors"
            f" ({_listed(unused)}); converting would drop them silently"
        )
    return source


def _all_written(source: SourceTensors, writer: str) -> None:
    dropped = source.never_loaded()
    if dropped:
        raise MegaUsageError(
            f"{source.where}: {len(dropped)} tensors taken from it were never written by the"
            f" {writer} writer ({_listed(dropped)})"
        )


def convert(
    src: Path,
    dst: Path,
    converters: Any,
    to: str | None = None,
    source: str | None = None,
    progress: Callable[[str, int], None] | None = None,
    start: Callable[[ModelWeights], None] | None = None,
    read_options: dict[str, Any] | None = None,
) -> ConversionReport:
    """Convert the checkpoint ``src`` into the new directory ``dst`` in format ``to``;
    ``read_options``: keyword hints for SRC's reader (``{"true_vocab_size": 50257}``)."""
    if not src.exists():
        raise MegaUsageError(f"{src}: does not exist")
    if dst.exists():
        raise MegaUsageError(f"{dst}: already exists; give a new directory")
    if not dst.parent.is_dir():
        raise MegaUsageError(f"{dst}: its parent directory {dst.parent} does not exist")
    reader = source_format(src, converters, source)
    target = converters.get(to or ("hf" if reader.name == "mega" else "mega"))
    if target.write is None:
        raise MegaUsageError(f"--to {target.name}: mega can only read this format")
    started = time.perf_counter()
    weights = _read(reader, src, read_options or {})
    source = _accounted(reader.name, weights)
    if start is not None:
        start(weights)
    if progress is not None:
        weights = _counted(weights, progress)
    tmp = dst.parent / f".{dst.name}.converting"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as exc:  # a read-only directory, /proc
        raise MegaUsageError(f"{dst}: cannot create it ({exc.strerror or exc})") from None
    try:
        notes = target.write(tmp, weights)
        _all_written(source, target.name)
        tmp.rename(dst)
    except OSError as exc:  # writing (reading the source is SourceTensors' to report)
        shutil.rmtree(tmp, ignore_errors=True)
        where = exc.filename or dst
        raise MegaRunError(f"{dst}: cannot write {where} ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConversionReport(
        reader.name,
        target.name,
        len(weights.tensors),
        sum(t.nbytes for t in weights.tensors.values()),
        time.perf_counter() - started,
        dict(source.ignored),
        list(notes or []),
    )
