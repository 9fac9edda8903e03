"""Word and learned position embeddings with their dropout (Megatron-core's parameter names:
``word_embeddings``, ``position_embeddings``). The GPT's and T5's embedding; BERT's extends it."""

from __future__ import annotations

import torch
from torch import nn

from mega.plugins.models.common.config import GPTConfig


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig, vocab_size: int, max_positions: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, cfg.hidden_size)  # [V, h]
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(max_positions, cfg.hidden_size)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.embedding_dropout(self.embed(tokens, position_ids))

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Word plus position embeddings ``[b, s, h]``, before the dropout (a subclass adds
        its own embeddings there: BERT's token types)."""
        hidden = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            seq_length = tokens.shape[1]
            if seq_length > self.position_embeddings.num_embeddings:
                raise ValueError(
                    f"sequence length {seq_length} exceeds --max-position-embeddings "
                    f"({self.position_embeddings.num_embeddings})"
                )
            if position_ids is None:
                hidden = hidden + self.position_embeddings.weight[:seq_length][None]
            else:  # [b, s]: positions restart after each document with --reset-position-ids
                hidden = hidden + self.position_embeddings(position_ids)
        return hidden
