"""How many parameters a model has, the same number in every layout.

Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` x TP size, so
the embedding and output layer of a TP=2 run have more rows than at TP=1; those rows are never
used (their logits are masked). Counting them would print another model size per layout.
"""

from __future__ import annotations

from typing import Any


def unpadded_parameter_count(model: Any, plan: Any, vocab: int, padded_vocab: int) -> int:
    """Parameters of ``model`` (a whole, unsharded model; shared ones once) without the padding
    rows of its vocabulary-sized weights: those its plan names (``vocab_parameters``, the ones
    a checkpoint stores without padding), never another weight that has ``padded_vocab`` rows
    by coincidence (a final norm of hidden size 512 at a vocabulary padded to 512). Without a
    plan, nothing is known to be padding and everything is counted."""
    names = set(plan.vocab_parameters) if plan is not None else set()
    return sum(
        p.numel() // padded_vocab * vocab
        if name in names and p.dim() and p.shape[0] == padded_vocab
        else p.numel()
        for name, p in model.named_parameters()
    )
