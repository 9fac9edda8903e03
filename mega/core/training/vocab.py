"""Vocabulary padding, as Megatron does it."""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple`` (--make-vocab-size-divisible-by x TP),
    so the embedding splits evenly across tensor-parallel ranks and matmuls stay aligned."""
    if multiple < 1:
        raise ValueError("the vocab padding multiple must be at least 1")
    return -(-vocab_size // multiple) * multiple
