"""Picking positions out of a batch of sequences: what the single-device and the vocab-parallel
output heads share when a model asks for its loss at some positions only."""

from __future__ import annotations

import torch


def at_positions(
    hidden: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden [b, s, h]`` and ``labels [b, s]`` at the flat ``positions [n]`` only:
    ``[1, n, h]`` and ``[1, n]`` (BERT predicts 15% of its positions: the vocabulary-sized
    product and loss then run on those alone)."""
    hidden = hidden.flatten(0, 1).index_select(0, positions)[None]
    if labels is not None:
        labels = labels.flatten().index_select(0, positions)[None]
    return hidden, labels
