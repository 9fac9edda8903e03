"""How many parameters a model has, the same number in every layout.

Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` x TP size, so
the embedding and output layer of a TP=2 run have more rows than at TP=1; those rows are never
used (their logits are masked). Counting them would print another model size per layout.
"""

from __future__ import annotations

from typing import Any

from mega.parallel.plan import layer_lists


def unpadded_parameter_count(model: Any, plan: Any, vocab: int, padded_vocab: int) -> int:
    """Parameters of ``model`` (a whole, unsharded model; shared ones once) without the padding
    rows of its vocabulary-sized weights: those with ``padded_vocab`` rows outside the transformer
    layers (the embedding, an untied output layer; a layer's own weight may have as many rows by
    coincidence). Without a plan, nothing is known to be padding and everything is counted."""
    if plan is None:
        return sum(p.numel() for p in model.parameters())
    in_layers = {
        id(p) for path in layer_lists(plan) for p in model.get_submodule(path).parameters()
    }
    return sum(
        p.numel() // padded_vocab * vocab
        if id(p) not in in_layers and p.dim() and p.shape[0] == padded_vocab
        else p.numel()
        for p in model.parameters()
    )
