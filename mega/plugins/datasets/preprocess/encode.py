"""The worker side of ``mega preprocess``: one chunk of JSONL bytes in, flat token arrays out.

Per line this follows Megatron-LM's ``tools/preprocess_data.py`` (``Encoder.encode``): each json
key's text is tokenized, as one piece, as the pieces of ``--split-sentences``, or as the items of a
JSON list of strings (already split sentences); empty pieces are dropped; with ``--append-eod`` the
tokenizer's ``eod`` is appended to the last piece of a document that has any tokens; a document
with no tokens still closes a document. Blank lines are ignored.

A worker returns, per json key, ``tokens`` (concatenated, in the dataset's dtype), ``lengths``
(one int32 per sequence) and ``doc_ends`` (sequences from the chunk's start to each document's
end) — what ``IndexedDatasetBuilder.add_flat`` writes in one call.

Texts are tokenized with ``tokenize_batch`` when the tokenizer has one (Rust tokenizers batch
well), in batches of about 512K characters whose ids become numpy arrays at once, else piece by
piece with ``tokenize``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from mega.plugins.datasets.preprocess.inputs import Chunk
from mega.plugins.datasets.preprocess.splitter import split_sentences

TOKENIZE_BATCH_CHARS = 1 << 19  # characters per tokenize_batch call (bounds worker memory)


@dataclass(frozen=True)
class EncodeOptions:
    json_keys: tuple[str, ...]
    dtype: str  # numpy dtype name of the output tokens
    eod: int | None  # appended to each non-empty document when not None
    split_sentences: bool = False
    keep_newlines: bool = False
    skip_bad_lines: bool = False


@dataclass
class KeyArrays:
    tokens: np.ndarray
    lengths: np.ndarray  # int32, one per sequence
    doc_ends: np.ndarray  # int64, one per document


@dataclass
class ChunkResult:
    """What one chunk became. ``bad`` lists (line, reason) in line order; with
    ``skip_bad_lines`` off, a chunk with a bad line carries only that first one."""

    file_index: int
    docs: int = 0
    tokens: int = 0
    text_bytes: int = 0
    keys: list[KeyArrays] = field(default_factory=list)
    bad: list[tuple[int, str]] = field(default_factory=list)


class BadLine(Exception):
    def __init__(self, reason: str):
        self.reason = reason


# Set by ``init_worker`` in each worker process (inherited through fork, never pickled).
_TOKENIZER: Any = None
_OPTIONS: EncodeOptions | None = None
_MALLOC_TRIM: Any = None
_STARTED: Any = None


def init_worker(
    tokenizer: Any, options: EncodeOptions, threads_per_worker: int, started: Any = None
) -> None:
    """Worker start-up: die with the parent; Ctrl-C is the parent's to handle, SIGTERM (the
    parent stopping us) ends the worker; size the tokenizer's own threads."""
    global _TOKENIZER, _OPTIONS, _STARTED
    from mega.plugins.datasets.preprocess.orphans import die_with_parent

    die_with_parent()  # a SIGKILLed parent runs no cleanup: the kernel ends the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _TOKENIZER, _OPTIONS, _STARTED = tokenizer, options, started
    configure_tokenizer_threads(threads_per_worker)


def configure_tokenizer_threads(threads: int) -> None:
    """Let Rust ``tokenizers`` use ``threads`` threads in this process, unless the user chose
    (``TOKENIZERS_PARALLELISM`` / ``RAYON_NUM_THREADS`` set in the environment)."""
    if "TOKENIZERS_PARALLELISM" in os.environ:
        return
    if threads <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


def worker_ready() -> int:
    """A start-up task. Each waits at the barrier ``started`` for all the others, so the
    parent's ``workers`` start-up tasks run in ``workers`` distinct processes: every worker has
    run ``init_worker`` (its signal handlers set) before any real work is sent."""
    if _STARTED is not None:
        _STARTED.wait(timeout=300)
    return os.getpid()


def encode_chunk(chunk: Chunk) -> ChunkResult:
    """Entry point of a worker task (uses the tokenizer and options set by ``init_worker``)."""
    try:
        return encode_lines(chunk, _TOKENIZER, _OPTIONS)
    finally:
        release_free_memory()


def release_free_memory() -> None:
    """Hand freed heap back to the OS. glibc keeps it otherwise, and raises its mmap threshold
    after large frees, so chunk-sized buffers end up fragmenting the heap: RSS then creeps up
    with the input size (parent) or stays at the high-water mark of the largest document seen
    so far (worker). Called once per chunk on both sides; it takes well under a millisecond."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


def encode_lines(chunk: Chunk, tokenizer: Any, options: EncodeOptions) -> ChunkResult:
    result = ChunkResult(chunk.file_index, text_bytes=len(chunk.data))
    records: list[tuple[int, list[list[str]]]] = []  # (line, pieces per key)
    for offset, raw in enumerate(chunk.data.split(b"\n")):
        if not raw or raw.isspace():
            continue
        line = chunk.first_line + offset
        try:
            records.append((line, _pieces(raw, options)))
        except BadLine as bad:
            result.bad.append((line, bad.reason))
            if not options.skip_bad_lines:
                return result
    while True:
        try:
            result.keys = [
                _encode_key(tokenizer, options, [pieces[k] for _, pieces in records])
                for k in range(len(options.json_keys))
            ]
            break
        except Exception:
            # Some line did not tokenize (e.g. a lone surrogate, a NullTokenizer non-number):
            # find which, one record at a time, then report it or drop it and go again.
            failed = _failing_records(tokenizer, options, records)
            if not failed:
                raise
            result.bad = sorted(result.bad + failed)
            if not options.skip_bad_lines:
                result.bad = result.bad[:1]
                return result
            lines = {line for line, _ in failed}
            records = [r for r in records if r[0] not in lines]
    result.docs = len(records)
    result.tokens = sum(int(k.tokens.size) for k in result.keys)
    return result


def _pieces(raw: bytes, options: EncodeOptions) -> list[list[str]]:
    """The text pieces of one JSONL line, per json key (raises ``BadLine``)."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise BadLine(f"not valid UTF-8 ({exc})") from None
    except ValueError as exc:
        raise BadLine(f"malformed JSON ({exc})") from None
    if not isinstance(record, dict):
        raise BadLine(f"not a JSON object (got {type(record).__name__})")
    out = []
    for key in options.json_keys:
        if key not in record:
            raise BadLine(f"no key '{key}'")
        value = record[key]
        if isinstance(value, str):
            if options.split_sentences:
                out.append(split_sentences(value, options.keep_newlines))
            else:
                out.append([value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out.append(value)  # already split into sentences, as Megatron accepts
        else:
            raise BadLine(f"key '{key}' is not a string or a list of strings")
    return out


def tokenize_texts(tokenizer: Any, texts: list[str]) -> list:
    """Each text's token ids, through ``tokenize_batch`` when the tokenizer has one."""
    batch = getattr(tokenizer, "tokenize_batch", None)
    if batch is not None:
        return batch(texts) if texts else []
    return [tokenizer.tokenize(text) for text in texts]


def _tokenize_flat(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(all token ids concatenated, tokens per text) as int64 arrays.

    Texts go to the tokenizer in batches of about ``TOKENIZE_BATCH_CHARS`` characters, each
    turned into arrays at once: a library's per-token objects (Rust encodings, Python int lists)
    take ~100 bytes per token, so this bounds a worker's memory whatever the chunk size.
    """
    token_parts: list[np.ndarray] = []
    length_parts: list[np.ndarray] = []
    start, size = 0, 0
    for end, text in enumerate(texts, 1):
        size += len(text)
        if size < TOKENIZE_BATCH_CHARS and end < len(texts):
            continue
        ids = tokenize_texts(tokenizer, texts[start:end])
        lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        if ids and isinstance(ids[0], np.ndarray):
            tokens = np.concatenate(ids).astype(np.int64, copy=False)
        else:
            tokens = np.fromiter(chain.from_iterable(ids), np.int64, int(lengths.sum()))
        token_parts.append(tokens)
        length_parts.append(lengths)
        start, size = end, 0
    if not token_parts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if len(token_parts) == 1:
        return token_parts[0], length_parts[0]
    return np.concatenate(token_parts), np.concatenate(length_parts)


def _encode_key(tokenizer: Any, options: EncodeOptions, docs: list[list[str]]) -> KeyArrays:
    """Tokenize every document's pieces of one key and lay them out as ``add_flat`` wants."""
    counts = np.fromiter((len(pieces) for pieces in docs), np.int64, len(docs))
    tokens, lengths = _tokenize_flat(tokenizer, list(chain.from_iterable(docs)))
    dtype = np.dtype(options.dtype)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        bad = int(tokens.max() if tokens.max() > np.iinfo(dtype).max else tokens.min())
        raise ValueError(f"token id {bad} does not fit the dataset dtype {dtype}")

    kept = lengths > 0  # empty pieces (sentences) are dropped, as in Megatron
    seq_lengths = lengths[kept]
    kept_before = np.concatenate(([0], np.cumsum(kept)))
    piece_ends = np.cumsum(counts)
    kept_per_doc = kept_before[piece_ends] - kept_before[piece_ends - counts]
    doc_ends = np.cumsum(kept_per_doc)
    if options.eod is not None:
        last = doc_ends[kept_per_doc > 0] - 1  # last sequence of each non-empty document
        token_ends = np.cumsum(seq_lengths)
        tokens = np.insert(tokens, token_ends[last], options.eod)
        seq_lengths[last] += 1
    return KeyArrays(tokens.astype(dtype), seq_lengths.astype(np.int32), doc_ends)


def _failing_records(
    tokenizer: Any, options: EncodeOptions, records: list[tuple[int, list[list[str]]]]
) -> list[tuple[int, str]]:
    failed = []
    for line, pieces in records:
        for k in range(len(options.json_keys)):
            try:
                _encode_key(tokenizer, options, [pieces[k]])
            except Exception as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                failed.append((line, f"cannot tokenize key '{options.json_keys[k]}' ({reason})"))
                break
    return failed
