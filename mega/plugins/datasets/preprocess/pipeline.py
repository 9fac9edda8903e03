"""The parent side of ``mega preprocess``: read chunks, fan them out to workers, write in order.

Process model (why: on a small machine the parent must stay nearly idle, and memory must not
grow with the input):

- The parent reads the input as chunks of whole lines (``inputs.read_chunks``, a few MB each)
  and submits each, as raw bytes, to a pool of ``--workers`` forked processes. A worker does all
  the CPU work of its chunk: JSON parsing, sentence splitting, tokenizing (``tokenize_batch``
  over ~512K characters at a time), and packing flat numpy arrays (``encode.encode_chunk``).
- At most ``2 x workers`` chunks are in flight; the parent takes results back in submission
  order, so the output order is the input order whatever the worker count, and writes each
  chunk's arrays with one ``IndexedDatasetBuilder.add_flat`` call per key. Memory is bounded by
  the in-flight chunks plus the index (12 bytes per sequence), not by the input size.
- Each worker lets the tokenizer's own thread pool (Rust ``tokenizers``) use
  ``cores // workers`` threads: one thread each with the default ``--workers`` (= cores), the
  whole machine for ``--workers 1``. ``TOKENIZERS_PARALLELISM`` in the environment overrides.
- The builders write under temporary names and rename at the very end: a failure of any kind
  (bad line, missing file, Ctrl-C, a dead worker) aborts them, so no output is left behind.
- ``--partitions K`` splits the input *file list* into K contiguous groups, writes each group to
  its own dataset in a hidden temporary directory next to the output, then concatenates them with
  ``add_index`` as Megatron does. The groups share one worker pool, one after another (the pool
  already uses every core), so the result is identical to ``--partitions 1``.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from mega.errors import MegaUsageError
from mega.plugins.datasets.indexed import IndexedDatasetBuilder, optimal_dtype
from mega.plugins.datasets.preprocess import orphans, stopping
from mega.plugins.datasets.preprocess.config import PreprocessConfig, available_cores
from mega.plugins.datasets.preprocess.encode import (
    EncodeOptions,
    encode_chunk,
    init_worker,
    release_free_memory,
    worker_ready,
)
from mega.plugins.datasets.preprocess.inputs import (
    Chunk,
    expand_inputs,
    read_chunks,
    total_disk_bytes,
)
from mega.plugins.datasets.preprocess.progress import Progress, Totals

DEFAULT_CHUNK_BYTES = 1 << 20
WARN_BAD_LINES = 10  # with --skip-bad-lines, the first few are shown, then only counted


@dataclass
class PreprocessResult:
    totals: Totals
    outputs: list[str]  # the written prefixes, one per json key
    dtype: str


def output_prefixes(prefix: str, json_keys: list[str], split_sentences: bool) -> list[str]:
    """Megatron's names: ``{prefix}_{key}_document`` (``_sentence`` with --split-sentences)."""
    level = "sentence" if split_sentences else "document"
    return [f"{prefix}_{key}_{level}" for key in json_keys]


def check_output_prefixes(flag_value: str, outputs: list[str]) -> None:
    """Fail early, naming the problem, when the outputs cannot be written."""
    for out in outputs:
        directory = os.path.dirname(out) or "."
        if not os.path.exists(directory):
            raise MegaUsageError(
                f"--output-prefix {flag_value}: directory '{directory}' does not exist"
            )
        if not os.path.isdir(directory):
            raise MegaUsageError(f"--output-prefix {flag_value}: '{directory}' is not a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise MegaUsageError(
                f"--output-prefix {flag_value}: directory '{directory}' is not writable"
            )
        for path in (f"{out}.bin", f"{out}.idx"):
            if os.path.isdir(path):
                raise MegaUsageError(f"--output-prefix {flag_value}: {path} is a directory")


def preprocess(
    config: PreprocessConfig,
    tokenizer: Any,
    *,
    stream: TextIO | None = None,
    tty: bool | None = None,
    chunk_bytes: int | None = None,
) -> PreprocessResult:
    """Tokenize ``config.input`` into ``.bin/.idx`` datasets; see this module's docstring.

    Raises ``MegaUsageError`` (one line, no output left behind) for a missing input, an
    unwritable output, or a bad line (unless ``config.skip_bad_lines``).
    """
    problems = config.validate()
    if problems:
        raise MegaUsageError(problems)
    totals = Totals()
    files = expand_inputs(config.input)
    outputs = output_prefixes(config.output_prefix, config.json_keys, config.split_sentences)
    check_output_prefixes(config.output_prefix, outputs)
    for path in orphans.remove_stale_temporaries(outputs):  # left by a killed earlier run
        print(f"removed {path}, left by an earlier run that was killed", file=stream or sys.stderr)
    dtype = np.dtype(optimal_dtype(getattr(tokenizer, "vocab_size", None)))
    eod = None
    if config.append_eod:
        eod = getattr(tokenizer, "eod", None)
        if eod is None:
            raise MegaUsageError(f"--append-eod: {type(tokenizer).__name__} has no eod token")
    options = EncodeOptions(
        json_keys=tuple(config.json_keys),
        dtype=dtype.name,
        eod=eod,
        split_sentences=config.split_sentences,
        keep_newlines=config.keep_newlines,
        skip_bad_lines=config.skip_bad_lines,
    )
    if chunk_bytes is None:
        chunk_bytes = int(os.environ.get("MEGA_PREPROCESS_CHUNK_BYTES", DEFAULT_CHUNK_BYTES))
    workers = config.worker_count
    groups = _partition(files, config.partitions)

    run = _Run(config, files, options, totals, chunk_bytes, max_inflight=2 * workers)
    executor = None
    builders: list[IndexedDatasetBuilder] = []
    tmpdir = None
    ok = False
    try:
        executor = _start_pool(tokenizer, options, workers)
        with Progress(
            totals, total_disk_bytes(files), config.log_interval, stream, tty
        ) as progress:
            run.progress = progress
            if len(groups) == 1:
                builders = _open_builders(config.output_prefix, outputs, dtype)
                run.process(executor, groups[0], builders)
            else:
                tmpdir = tempfile.mkdtemp(
                    prefix=orphans.temporary_dir_prefix(), dir=os.path.dirname(outputs[0]) or "."
                )
                parts = []
                for i, group in enumerate(groups):
                    names = [
                        os.path.join(tmpdir, f"part{i}_{os.path.basename(o)}") for o in outputs
                    ]
                    builders = _open_builders(config.output_prefix, names, dtype)
                    run.process(executor, group, builders)
                    _finalize(config.output_prefix, builders)
                    builders = []
                    parts.append(names)
                builders = _open_builders(config.output_prefix, outputs, dtype)
                for names in parts:
                    for builder, name in zip(builders, names, strict=True):
                        stopping.check()
                        _write(config.output_prefix, builder.add_index, name)
        _check_not_empty(files, totals)  # an empty dataset would only fail at training
        stopping.check()  # the last point where a stop leaves no output
        _finalize(config.output_prefix, builders)  # the outputs appear only now
        builders = []
        ok = True
    except BrokenProcessPool:
        raise MegaUsageError(
            "a preprocessing worker died unexpectedly (out of memory?); no output was written"
        ) from None
    finally:
        for builder in builders:
            builder.abort()
        if executor is not None:
            _stop_pool(executor, graceful=ok)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return PreprocessResult(totals, outputs, dtype.name)


class _Run:
    """The chunk loop, shared by every partition of one run."""

    def __init__(self, config, files, options, totals, chunk_bytes, max_inflight):
        self.config = config
        self.files = files
        self.options = options
        self.totals = totals
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.progress: Progress | None = None

    def process(
        self,
        executor: ProcessPoolExecutor,
        group: tuple[int, list[str]],
        builders: list[IndexedDatasetBuilder],
    ) -> None:
        first, files = group
        inflight: deque[tuple[Chunk, Future | None]] = deque()
        for chunk in read_chunks(files, self.chunk_bytes, first_index=first):
            stopping.check()
            future = executor.submit(encode_chunk, chunk) if chunk.data else None
            inflight.append((chunk, future))
            if len(inflight) >= self.max_inflight:
                self._consume(*inflight.popleft(), builders)
        while inflight:
            self._consume(*inflight.popleft(), builders)

    def _consume(self, chunk: Chunk, future: Future | None, builders) -> None:
        stopping.check()  # a Ctrl-C or SIGTERM (recorded by its handler)
        totals = self.totals
        totals.disk_bytes += chunk.disk_bytes
        if future is None:
            self.progress.update()
            return
        result = stopping.result(future)
        name = self.files[result.file_index]
        if result.bad and not self.options.skip_bad_lines:
            line, reason = result.bad[0]
            raise MegaUsageError(f"{name}:{line}: {reason}")
        for line, reason in result.bad:
            totals.bad_lines += 1
            if totals.bad_lines <= WARN_BAD_LINES:
                self.progress.warn(f"warning: {name}:{line}: {reason}; skipped")
        for builder, arrays in zip(builders, result.keys, strict=True):
            _write(
                self.config.output_prefix,
                builder.add_flat,
                arrays.tokens,
                arrays.lengths,
                arrays.doc_ends,
            )
        totals.docs += result.docs
        totals.tokens += result.tokens
        totals.text_bytes += result.text_bytes
        del result
        release_free_memory()
        self.progress.update()


def _check_not_empty(files: list[str], totals: Totals) -> None:
    """No output at all rather than a dataset without a token (nothing can train on it)."""
    if totals.tokens:
        return
    where = f"--input {files[0]}" if len(files) == 1 else f"--input ({len(files)} files)"
    if totals.docs:
        found = f"its {totals.docs} documents are empty once tokenized"
    else:
        skipped = f" ({totals.bad_lines} bad lines skipped)" if totals.bad_lines else ""
        found = f"no documents{skipped}"
    raise MegaUsageError(f"{where}: {found}; nothing written")


def _partition(files: list[str], k: int) -> list[tuple[int, list[str]]]:
    """K contiguous groups of the file list, as even as possible: (index of first file, files)."""
    k = max(1, k)
    groups = []
    for i in range(k):
        start, stop = len(files) * i // k, len(files) * (i + 1) // k
        groups.append((start, files[start:stop]))
    return groups


def _open_builders(flag_value: str, prefixes: Iterable[str], dtype) -> list[IndexedDatasetBuilder]:
    builders: list[IndexedDatasetBuilder] = []
    try:
        for prefix in prefixes:
            builders.append(IndexedDatasetBuilder(prefix, dtype=dtype))
    except OSError as exc:
        for builder in builders:
            builder.abort()
        raise MegaUsageError(
            f"--output-prefix {flag_value}: cannot write {exc.filename or prefix}: {exc.strerror}"
        ) from None
    return builders


def _write(flag_value: str, method, *args) -> None:
    try:
        method(*args)
    except OSError as exc:
        raise MegaUsageError(
            f"--output-prefix {flag_value}: cannot write: {exc.strerror or exc}"
        ) from None


def _finalize(flag_value: str, builders: list[IndexedDatasetBuilder]) -> None:
    for builder in builders:
        _write(flag_value, builder.finalize)


def _start_pool(tokenizer: Any, options: EncodeOptions, workers: int) -> ProcessPoolExecutor:
    """Fork every worker now, before a progress thread exists. The tokenizer reaches the
    workers through fork (it is never pickled, so any tokenizer object works)."""
    threads = max(1, available_cores() // workers)
    context = multiprocessing.get_context("fork")
    executor = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=context,
        initializer=init_worker,
        initargs=(tokenizer, options, threads, context.Barrier(workers)),
    )
    try:
        for future in [executor.submit(worker_ready) for _ in range(workers)]:
            stopping.result(future)
    except BaseException:
        _stop_pool(executor, graceful=False)
        raise
    return executor


def _stop_pool(executor: ProcessPoolExecutor, graceful: bool) -> None:
    """Graceful: let the (idle) workers exit. Otherwise (error, Ctrl-C) stop them at once."""
    if not graceful:
        # concurrent.futures has no public "terminate": reach for its process table.
        for process in list((getattr(executor, "_processes", None) or {}).values()):
            if process.is_alive():
                process.terminate()
    executor.shutdown(wait=True, cancel_futures=True)
