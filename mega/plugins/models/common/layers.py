"""The pre-norm transformer layer and the stack of them (``layers``, ``final_layernorm``, the RoPE
tables): the GPT's decoder, BERT's and T5's encoders and, with T5's layers, its decoder."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mega.plugins.models.common.attention import KVCache, SelfAttention
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.mlp import MLP
from mega.plugins.models.common.moe import MoELayer
from mega.plugins.models.common.norms import norm_layer
from mega.plugins.models.common.rotary import rotary_cos_sin


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, cfg: GPTConfig, moe: bool = False, causal: bool = True) -> None:
        super().__init__()
        self.input_layernorm = norm_layer(cfg, cfg.hidden_size)
        self.self_attention = SelfAttention(cfg, causal)
        self.pre_mlp_layernorm = norm_layer(cfg, cfg.hidden_size)
        if moe:  # the experts replace the MLP (common/moe.py)
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp = MoELayer(cfg, MLP(cfg, shared) if shared else None)
        else:
            self.mlp = MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        attention = self.self_attention(
            self.input_layernorm(hidden), rotary, attention_mask, kv_cache
        )
        hidden = hidden + self.hidden_dropout(attention)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


class TransformerBlock(nn.Module):
    """The decoder stack. It computes the RoPE tables itself so that any slice of it can run alone.

    ``sequence_shards`` is how many ranks the input's sequence is split over (sequence parallelism
    sets it to the tensor-parallel size): the RoPE tables must cover the full sequence, because
    attention sees all of it after the QKV projection gathers the shards.

    ``layer(cfg, moe, causal)`` builds each layer (BERT's post-norm layers replace the GPT's);
    ``final_norm``: end in a norm (pre-norm stacks do; post-norm ones are normalised already).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        causal: bool = True,
        layer: Callable[[GPTConfig, bool, bool], nn.Module] = TransformerLayer,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(cfg, moe, causal) for moe in cfg.moe_layers())
        self.final_layernorm = norm_layer(cfg, cfg.hidden_size) if final_norm else None
        self.rope = cfg.rotary()
        self.yarn = cfg if cfg.position_embedding_type == "yarn" else None
        self.head_dim = cfg.resolved_kv_channels()
        self.rotary_base = cfg.rotary_base
        self.llama3_factor = cfg.rope_scaling_factor if cfg.use_rope_scaling else None
        self.interpolation = cfg.rotary_seq_len_interpolation_factor
        self.sequence_shards = 1

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        rotary = None
        if self.rope:
            seq_length = hidden.shape[1] * self.sequence_shards  # explicit position_ids are full
            rotary = rotary_cos_sin(
                seq_length, self.head_dim, self.rotary_base, hidden.device, position_ids,
                llama3_factor=self.llama3_factor, interpolation=self.interpolation,
                yarn=self.yarn,
            )  # fmt: skip
        for layer in self.layers:
            if kv_cache is None:  # the call parallel plugins and compile see
                hidden = layer(hidden, rotary, attention_mask)
            else:
                hidden = layer(hidden, rotary, attention_mask, kv_cache)
        if self.final_layernorm is None:  # a pipeline stage before the last, or post-norm layers
            return hidden
        return self.final_layernorm(hidden)
