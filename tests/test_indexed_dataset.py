"""mega's .bin/.idx reader and builder against megatron-core's, byte for byte, both directions."""

from __future__ import annotations

import filecmp
import warnings
from pathlib import Path

import numpy as np
import pytest

from mega.plugins.datasets.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_dtype,
)

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def random_documents(seed: int, vocab: int = 60000) -> list[list[np.ndarray]]:
    """Documents of 0-3 sentences of 0-20 tokens: empty documents and sentences included."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, vocab, rng.integers(0, 20)) for _ in range(rng.integers(0, 4))]
        for _ in range(60)
    ]


def write_with_megatron(prefix: Path, documents, dtype) -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        builder = megatron_indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
        for document in documents:
            for sentence in document:
                builder.add_item(torch.from_numpy(np.asarray(sentence, dtype=np.int64)))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_are_byte_identical_to_megatron_core(tmp_path: Path, dtype):
    documents = random_documents(0, vocab=60000 if dtype == np.uint16 else 200000)
    ours = IndexedDatasetBuilder(tmp_path / "ours", dtype=dtype)
    for document in documents:
        ours.add_document(document)
    ours.finalize()
    write_with_megatron(tmp_path / "theirs", documents, dtype)
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"ours{suffix}", tmp_path / f"theirs{suffix}", shallow=False)


def test_each_reads_the_other(tmp_path: Path):
    documents = random_documents(1)
    flat = [sentence for document in documents for sentence in document]
    ours = IndexedDatasetBuilder(tmp_path / "ours", dtype=np.uint16)
    for document in documents:
        ours.add_document(document)
    ours.finalize()
    write_with_megatron(tmp_path / "theirs", documents, np.uint16)

    theirs_reading_ours = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    ours_reading_theirs = IndexedDataset(tmp_path / "theirs")
    assert len(theirs_reading_ours) == len(ours_reading_theirs) == len(flat)
    for i, sentence in enumerate(flat):
        assert np.array_equal(theirs_reading_ours[i], sentence)
        assert np.array_equal(ours_reading_theirs[i], sentence)
    expected_docs = np.cumsum([0] + [len(d) for d in documents])
    assert np.array_equal(ours_reading_theirs.document_indices, expected_docs)
    assert np.array_equal(theirs_reading_ours.document_indices, expected_docs)
    longest = int(np.argmax(ours_reading_theirs.sequence_lengths))
    assert np.array_equal(ours_reading_theirs.get(longest, 2, 3), flat[longest][2:5])


def test_flat_batches_and_merging_equal_item_by_item(tmp_path: Path):
    documents = random_documents(2)
    reference = IndexedDatasetBuilder(tmp_path / "reference", dtype=np.uint16)
    for document in documents:
        reference.add_document(document)
    reference.finalize()

    halves = []
    for part, chunk in enumerate((documents[:30], documents[30:])):
        builder = IndexedDatasetBuilder(tmp_path / f"part{part}", dtype=np.uint16)
        sentences = [s for d in chunk for s in d]
        tokens = np.concatenate(sentences) if sentences else np.empty(0)
        builder.add_flat(tokens, [len(s) for s in sentences], np.cumsum([len(d) for d in chunk]))
        builder.finalize()
        halves.append(tmp_path / f"part{part}")
    merged = IndexedDatasetBuilder(tmp_path / "merged", dtype=np.uint16)
    for half in halves:
        merged.add_index(half)
    merged.finalize()
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(
            tmp_path / f"merged{suffix}", tmp_path / f"reference{suffix}", shallow=False
        )


def test_nothing_is_visible_until_finalize_and_abort_leaves_nothing(tmp_path: Path):
    builder = IndexedDatasetBuilder(tmp_path / "data", dtype=np.uint16)
    builder.add_document([[1, 2, 3]])
    assert not (tmp_path / "data.bin").exists() and not (tmp_path / "data.idx").exists()
    builder.abort()
    assert list(tmp_path.iterdir()) == []


def test_damaged_files_are_clear_errors(tmp_path: Path):
    builder = IndexedDatasetBuilder(tmp_path / "data", dtype=np.uint16)
    builder.add_document([[1, 2, 3], [4, 5]])
    builder.finalize()
    with pytest.raises(IndexedDatasetError, match="no such file"):
        IndexedDataset(tmp_path / "missing")
    idx = (tmp_path / "data.idx").read_bytes()
    (tmp_path / "data.idx").write_bytes(idx[:-4])
    with pytest.raises(IndexedDatasetError, match="truncated"):
        IndexedDataset(tmp_path / "data")
    (tmp_path / "data.idx").write_bytes(b"NOTANIDX" + idx[8:])
    with pytest.raises(IndexedDatasetError, match="not a Megatron"):
        IndexedDataset(tmp_path / "data")
    (tmp_path / "data.idx").write_bytes(idx)
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(IndexedDatasetError, match="truncated"):
        IndexedDataset(tmp_path / "data")


def test_optimal_dtype_follows_megatron():
    assert optimal_dtype(50257) is np.uint16
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(128256) is np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_in_memory_reads_as_the_written_files(tmp_path: Path, dtype):
    """``IndexedDataset.in_memory`` (the embedded sentences) holds exactly what the builder
    writes for the same documents, empty sequences included, and reads it the same way."""
    documents = [[[5, 6, 7], [], [8]], [[9, 10]], []]
    builder = IndexedDatasetBuilder(tmp_path / "d", dtype=dtype)
    for document in documents:
        builder.add_document(document)
    builder.finalize()
    files, memory = IndexedDataset(tmp_path / "d"), IndexedDataset.in_memory(documents, dtype)
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        np.testing.assert_array_equal(getattr(memory, name), getattr(files, name), err_msg=name)
    assert (len(memory), memory.num_documents, memory.num_tokens) == (4, 3, 6)
    for i in range(len(files)):
        np.testing.assert_array_equal(memory[i], files[i])
        assert memory[i].dtype == files[i].dtype
        assert not (len(memory[i]) and memory[i].flags.writeable)  # a view of read-only bytes
    np.testing.assert_array_equal(memory.get(0, 1, 2), [6, 7])
