"""Which positions a context-parallel rank holds, and a micro-batch cut to them on the host.

Causal attention costs more for later positions, so contiguous shares would leave the last rank
with most of the work. As in Megatron (``get_batch_on_this_cp_rank``), the sequence is cut into
``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2*cp-1-r``: every rank then has the same
attention work.
"""

from __future__ import annotations

import numpy as np


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The global chunk indices (of ``2*cp``) that context-parallel rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def rank_positions(seq_length: int, rank: int, cp: int) -> np.ndarray:
    """The sequence positions rank ``rank`` holds, in its order (its two chunks)."""
    chunk = seq_length // (2 * cp)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, cp)])


def chunk_layout(cp: int) -> list[int]:
    """The global chunk at each place of the ``2*cp`` chunks laid out rank after rank (each
    rank's two chunks in its order): the inverse of :func:`global_order`."""
    return [c for rank in range(cp) for c in rank_chunks(rank, cp)]


def global_order(cp: int) -> list[int]:
    """For the ``2*cp`` chunks laid out rank after rank (each rank's two chunks in its order),
    the index in that layout of each global chunk: ``layout[global_order(cp)]`` is in global
    order."""
    layout = chunk_layout(cp)
    return [layout.index(c) for c in range(2 * cp)]


def split_microbatch(
    arrays: dict[str, np.ndarray], rank: int, cp: int, weight_key: str = "loss_mask"
) -> dict[str, np.ndarray]:
    """This rank's part of a micro-batch: every array with the sequence as its second dimension
    cut to the rank's positions; ``position_ids`` added (the positions it holds) if absent, so
    position embeddings and RoPE see true positions.

    Also ``cp_loss_weight``: the share of the micro-batch's loss-mask tokens this rank holds. A
    rank's loss is its masked mean times that share, so the shares' sum over the ranks is the
    micro-batch's masked mean, and summing gradients over ``cp`` gives the mean's gradient.
    """
    tokens = arrays["tokens"]
    b, seq_length = tokens.shape[:2]
    positions = rank_positions(seq_length, rank, cp)
    arrays = dict(arrays)
    arrays.setdefault("position_ids", np.broadcast_to(np.arange(seq_length), (b, seq_length)))
    out = {}
    for key, values in arrays.items():
        if values.ndim >= 2 and values.shape[1] == seq_length:
            out[key] = np.ascontiguousarray(values[:, positions])
        else:
            out[key] = values
    if weight_key in arrays:
        total = float(arrays[weight_key].sum())
        mine = float(out[weight_key].sum())
        out["cp_loss_weight"] = np.array(mine / total if total else 0.0, dtype=np.float32)
    return out
