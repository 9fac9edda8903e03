"""Megatron-LM's indexed dataset: ``prefix.bin`` (raw token ids) + ``prefix.idx`` (the index).

Byte-compatible with ``megatron/core/datasets/indexed_dataset.py`` (header ``MMIDIDX``, version 1).
All integers are little-endian. ``.idx`` layout::

    0          9 bytes   magic b"MMIDIDX\\x00\\x00"
    9          8 bytes   version <Q = 1
    17         1 byte    dtype code <B (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                        7 float32, 8 uint16)
    18         8 bytes   sequence count S <Q
    26         8 bytes   document_indices length D <Q (documents + 1)
    34         4*S       sequence_lengths int32
    34+4S      8*S       sequence_pointers int64 (byte offsets into .bin)
    34+12S     8*D       document_indices int64 (starts at 0, ends at S)
    34+12S+8D  1*S       sequence_modes int8 (multimodal only; never written here)

The reader memory-maps both files and never copies: ``dataset[i]`` is a view into ``.bin``.
The builder streams tokens to ``.bin`` as they come (memory holds only the index arrays, 12 bytes
per sequence) and writes under temporary names that are renamed only by ``finalize``.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def optimal_dtype(vocab_size: int | None) -> type:
    """uint16 when every id fits (Megatron's rule: vocab_size < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair that is missing, truncated or not Megatron's format."""


class IndexedDataset:
    """Zero-copy reader of one ``prefix.bin``/``prefix.idx`` pair."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx, binary = idx_path(prefix), bin_path(prefix)
        for path in (idx, binary):
            if not path.is_file():
                raise IndexedDatasetError(f"{path}: no such file")
        self._index = np.memmap(idx, dtype=np.uint8, mode="r")
        if len(self._index) < HEADER.size:
            raise IndexedDatasetError(f"{idx}: too short to be an index ({len(self._index)} bytes)")
        magic, version, code, count, doc_count = HEADER.unpack(bytes(self._index[: HEADER.size]))
        if magic != MAGIC or version != VERSION or code not in DTYPES:
            raise IndexedDatasetError(f"{idx}: not a Megatron MMIDIDX v1 index")
        self.dtype = np.dtype(DTYPES[code])
        offset = HEADER.size
        needed = offset + 12 * count + 8 * doc_count
        if len(self._index) < needed:
            raise IndexedDatasetError(f"{idx}: truncated ({len(self._index)} < {needed} bytes)")
        buffer = self._index._mmap if hasattr(self._index, "_mmap") else self._index
        self.sequence_lengths = np.frombuffer(buffer, np.int32, count, offset)
        self.sequence_pointers = np.frombuffer(buffer, np.int64, count, offset + 4 * count)
        self.document_indices = np.frombuffer(buffer, np.int64, doc_count, offset + 12 * count)
        if doc_count == 0 or self.document_indices[-1] != count:
            raise IndexedDatasetError(f"{idx}: document_indices does not end at {count}")
        expected_bytes = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if binary.stat().st_size < expected_bytes:
            raise IndexedDatasetError(f"{binary}: truncated (index expects {expected_bytes} bytes)")
        self._bin = np.memmap(binary, dtype=np.uint8, mode="r") if expected_bytes else None
        self._buffer = self._bin._mmap if self._bin is not None else b""

    @classmethod
    def in_memory(
        cls, documents: list[list[list[int]]], dtype: type = np.int32, name: str = "<memory>"
    ) -> IndexedDataset:
        """What ``IndexedDatasetBuilder`` would write for ``documents`` (each a list of
        sequences), held in memory and read the same way; ``name`` stands for the prefix in
        messages. Empty sequences are kept (the builder keeps them too)."""
        self = cls.__new__(cls)
        self.prefix = name
        self.dtype = np.dtype(dtype)
        sequences = [sequence for document in documents for sequence in document]
        self.sequence_lengths = np.asarray([len(s) for s in sequences], dtype=np.int32)
        starts = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=starts[1:])
        self.sequence_pointers = starts[:-1] * self.dtype.itemsize
        counts = np.asarray([len(document) for document in documents], dtype=np.int64)
        self.document_indices = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        flat = [token for sequence in sequences for token in sequence]
        self._bin = None
        self._buffer = np.asarray(flat, dtype=self.dtype).tobytes()  # read-only, as a memmap
        return self

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``index`` (a view, no copy)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {index} has {size} tokens; asked {offset}+{length}")
        if length == 0:
            return np.empty(0, dtype=self.dtype)
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._buffer, self.dtype, length, start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document(self, doc: int) -> list[np.ndarray]:
        """The sequences (sentences) of document ``doc``."""
        first, last = self.document_indices[doc], self.document_indices[doc + 1]
        return [self.get(i) for i in range(first, last)]


class IndexedDatasetBuilder:
    """Write a ``.bin``/``.idx`` pair incrementally; visible under ``prefix`` only after finalize.

    Usage::

        builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
        builder.add_document([tokens_of_sentence_1, tokens_of_sentence_2])
        builder.finalize()       # or builder.abort() on failure: nothing is left behind
    """

    def __init__(self, prefix: str | Path, dtype: type = np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self._tmp_bin = Path(f"{prefix}.bin.tmp-{os.getpid()}")
        self._tmp_idx = Path(f"{prefix}.idx.tmp-{os.getpid()}")
        self._file = open(self._tmp_bin, "wb")
        # int32 lengths and int64 document ends, in chunks concatenated at finalize: 12 bytes per
        # sequence, the least the .idx needs (no per-item Python objects)
        self._lengths: list[np.ndarray] = []
        self._documents: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._sequences = 0

    def add_item(self, tokens) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes(order="C"))
        self._lengths.append(np.array([array.size], dtype=np.int32))
        self._sequences += 1

    def end_document(self) -> None:
        self._documents.append(np.array([self._sequences], dtype=np.int64))

    def add_document(self, sequences) -> None:
        """Append a document given as a list of sequences (empty list: an empty document)."""
        for sequence in sequences:
            self.add_item(sequence)
        self.end_document()

    def add_flat(self, tokens: np.ndarray, lengths: np.ndarray, doc_ends: np.ndarray) -> None:
        """Append many sequences at once: ``tokens`` concatenated, ``lengths`` per sequence,
        ``doc_ends`` the number of sequences (counted from this call's first) closing each
        document. The fast path for preprocessing: one write per batch."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._file.write(memoryview(tokens).cast("B"))  # no intermediate bytes copy
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self._documents.append(self._sequences + np.asarray(doc_ends, dtype=np.int64))
        self._sequences += len(lengths)

    def add_index(self, prefix: str | Path) -> None:
        """Append another finished dataset (same dtype), as Megatron's merge does."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype} differs from {self.dtype}")
        self._file.flush()
        with open(bin_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._file, 1 << 24)
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._documents.append(self._sequences + np.asarray(other.document_indices[1:]))
        self._sequences += len(other)

    def finalize(self) -> None:
        """Write the index, fsync, then rename both files into place (``.bin`` first)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.empty(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.concatenate(self._documents)
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODES[self.dtype], len(lengths), len(documents)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        # A reader needs both files. Drop an old .idx first so an old index never pairs with the
        # new .bin, then rename .bin, and the .idx last: the pair is complete once it exists.
        idx_path(self.prefix).unlink(missing_ok=True)
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Remove the temporary files (after an error): nothing that looks complete remains."""
        if not self._file.closed:
            self._file.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)
