"""Output heads: hidden states x the output weight -> logits or the per-token loss (parameter-free,
swapped for a vocab-parallel head by tensor parallelism), and the tied output layer's bias that
BERT's and T5's language-model heads add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.parallel.positions import at_positions


class OutputHead(nn.Module):
    """Final hidden states x the ``[V, h]`` output weight -> logits, or the per-token loss.

    Parameter-free (the weight is passed in, tied or not), so tensor parallelism can swap it for
    a vocab-parallel head that never gathers the full-vocabulary logits.

    The padding rows of the vocabulary (ids >= ``vocab_size``) get logit -inf: they exist only so
    that the vocabulary splits evenly, and Megatron, which keeps them in the softmax, trains a
    model that changes with the tensor-parallel size (50257 pads to 50304 at TP=1, 50432 at TP=2).
    Masked, the loss and every real row's values are the same for any padding.
    """

    def __init__(self, vocab_size: int | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size  # the real vocabulary; None: no padding to mask

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden [b, s, h]`` -> logits ``[b, s, V]`` (plus ``bias [V]``: BERT's, T5's), or given
        ``labels [b, s]`` the float32 cross-entropy ``[b, s]``; given ``positions [n]`` too
        (flat indices into ``b x s``), only theirs: ``[1, n]``."""
        if positions is not None:
            hidden, labels = at_positions(hidden, labels, positions)
        logits = F.linear(hidden, weight, bias)  # [b, s, V]
        if self.vocab_size is not None and self.vocab_size < logits.shape[-1]:
            logits[..., self.vocab_size :] = float("-inf")  # linear's backward never reads it
        if labels is None:
            return logits
        # Cross-entropy in float32 whatever the model dtype: bf16 log-softmax over V loses digits.
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), reduction="none"
        )  # [b*s]
        return loss.view_as(labels)


class OutputBias(nn.Module):
    """The tied output layer's bias ``[V]`` (its weight is the word embeddings)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.empty(vocab_size))
