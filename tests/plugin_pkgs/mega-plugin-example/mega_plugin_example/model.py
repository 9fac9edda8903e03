"""``BigramLM``: the module behind the ``bigram`` model. Imported only by the factory (torch).

Shapes: ``b`` batch, ``s`` sequence, ``h`` hidden size, ``V`` padded vocab. Each position sees only
its own token, so this is a bigram model whose ``[V, V]`` table is factored as ``E @ W`` (rank
``h``) plus a bias row: a genuinely different LM from GPT, small enough to train in seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega import BuildContext, normal_
from mega_plugin_example.config import BigramConfig


class BigramLM(nn.Module):
    """``forward(tokens, labels=None)``: logits ``[b, s, V]``, or float32 loss ``[b, s]``."""

    def __init__(self, cfg: BigramConfig, ctx: BuildContext) -> None:
        super().__init__()
        problems = cfg.validate()
        if problems:
            raise ValueError("invalid bigram config: " + "; ".join(problems))
        if ctx.padded_vocab_size <= 0:
            raise ValueError("BuildContext.padded_vocab_size must be set before building the model")
        vocab, hidden = ctx.padded_vocab_size, cfg.hidden_size
        self.embedding = nn.Embedding(vocab, hidden)  # E: [V, h]
        self.output = nn.Linear(hidden, vocab, bias=cfg.output_bias)  # W: [V, h] (logits = x W^T)
        self.reset_parameters(cfg.init_method_std, ctx.seed)

    @torch.no_grad()
    def reset_parameters(self, std: float, seed: int) -> None:
        """Each weight from its own (seed, name) generator, so init ignores device and layout.

        With std 0.02 the initial logits are ~0: the first loss is about ln(V).
        """
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            else:
                normal_(param, std=std, seed=seed, name=name)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.output(self.embedding(tokens))  # [b, s, h] -> [b, s, V]
        if labels is None:
            return logits
        # Cross-entropy in float32 whatever the parameter dtype (bf16 log-softmax loses digits).
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return loss.view_as(labels)  # [b, s]
