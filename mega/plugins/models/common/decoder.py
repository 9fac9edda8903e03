"""The decoder-only language model (the GPT's architecture) with Megatron-core's parameter names
and initialisation: what the gpt and moe models build (moe is the GPT with other defaults).

Shapes: ``b`` batch, ``s`` sequence, ``h`` hidden, ``np`` query heads, ``ng`` query groups (key/value
heads), ``d`` head dim (kv channels), ``f`` ffn hidden, ``V`` padded vocab. Activations are kept
batch-first ``[b, s, h]``. No process groups here: parallel plugins rewrite this module from outside,
keyed on the parameter names below and on the module paths of ``decoder_plan.py``. Two
parameter-free submodules exist for them: ``core_attention`` (the SDPA call: wrapped to run under
the tensor-parallel RNG, or recomputed) and ``output_head`` (hidden states x output weight -> logits
or loss: swapped for a vocab-parallel head).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mega.core.plugins.specs import BuildContext
from mega.core.training.init import on_meta
from mega.plugins.models.common.attention import KVCache
from mega.plugins.models.common.checks import checked_max_positions
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.embedding import Embedding
from mega.plugins.models.common.heads import OutputHead
from mega.plugins.models.common.init import megatron_init_
from mega.plugins.models.common.layers import TransformerBlock


class GPTModel(nn.Module):
    """Decoder-only GPT. ``forward(tokens, labels=None)``: logits ``[b, s, V]`` or float32 loss ``[b, s]``."""

    def __init__(self, cfg: GPTConfig, ctx: BuildContext) -> None:
        super().__init__()
        max_positions = checked_max_positions(cfg, ctx, "GPT")
        self.config = cfg
        self.seed = ctx.seed
        self.share_embeddings_and_output_weights = not cfg.untie_embeddings_and_output_weights
        # Build on the meta device and materialise once: the default init would be thrown away.
        with on_meta():
            self.embedding = Embedding(cfg, ctx.padded_vocab_size, max_positions)
            self.decoder = TransformerBlock(cfg)
            self.output_layer = None
            if not self.share_embeddings_and_output_weights:
                self.output_layer = nn.Linear(cfg.hidden_size, ctx.padded_vocab_size, bias=False)
            vocab_size = getattr(ctx.tokenizer, "vocab_size", None)
            self.output_head = OutputHead(vocab_size)
        if ctx.device != "meta":  # a planning build (mega.core.plan): shapes, no init
            self.to_empty(device="cpu")
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init, drawn per parameter from (seed, name): layout-invariant."""
        cfg = self.config
        scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        megatron_init_(self, self.seed, cfg.init_method_std, lambda name: scaled_std)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, h]`` matrix that produces logits: the word embeddings when tied."""
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``tokens [b, s]``; optional ``position_ids [b, s]`` (--reset-position-ids) and
        ``attention_mask [b, 1, s, s]`` bool, True = masked (--reset-attention-mask).
        ``kv_cache`` (generation): ``tokens`` are the new positions after those in the cache,
        ``position_ids`` their positions, ``attention_mask [b, 1, s_new, s_all]``.

        As a pipeline stage (``decoder_plan.py``): ``hidden_states [b, s, h]`` is the previous stage's
        output and replaces the embedding; a stage without the output head returns its hidden
        states."""
        if hidden_states is None:
            hidden = self.embedding(tokens, position_ids)  # [b, s, h]
        else:
            hidden = hidden_states
        if kv_cache is None:
            hidden = self.decoder(hidden, position_ids, attention_mask)
        else:
            hidden = self.decoder(hidden, position_ids, attention_mask, kv_cache)
        if self.output_head is None:
            return hidden
        return self.output_head(hidden, self.output_weight(), labels)
