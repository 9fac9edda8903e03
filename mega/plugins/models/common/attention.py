"""Attention: the parameter-free core attention (its kernel from ``--attention-backend``, one
table with context parallelism's: ``mega.parallel.attention_kernels``),
self-attention with grouped query/key/value rows (Megatron's ``linear_qkv``/``linear_proj``),
the KV cache generation feeds, and the key padding mask of the encoders (BERT's, T5's).

``core_attention`` is its own submodule for the parallel plugins: wrapped to run under the
tensor-parallel RNG, recomputed, or replaced by context-parallel attention.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from mega.parallel.attention_kernels import SDPA_BACKENDS, attention_kernel
from mega.parallel.linear import Linear
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.norms import norm_layer
from mega.plugins.models.common.rotary import apply_rotary

# The built-in --attention-backend names -> the SDPA kernels allowed, as the kernel table has
# them (kept for code that enters the same context around its own SDPA calls)
SDPA_KERNELS = {name: list(backends) for name, backends in SDPA_BACKENDS.items()}


def sdpa_backends(backend: str) -> contextlib.AbstractContextManager:
    """The context that makes SDPA use the kernels ``--attention-backend`` names."""
    if backend in SDPA_KERNELS:
        return sdpa_kernel(SDPA_KERNELS[backend])
    return contextlib.nullcontext()


class CoreAttention(nn.Module):
    """Scaled dot-product attention with causal or explicit masking; no parameters.

    Its own module so that parallel plugins can run it under another RNG (its dropout acts on
    tensor-parallel-sharded heads) or recompute it in backward (selective recompute).
    ``causal``: with no explicit mask, each position sees those up to itself (a decoder); else
    every position (an encoder: BERT's, T5's, and cross-attention).
    """

    def __init__(self, dropout_p: float, backend: str = "auto", causal: bool = True) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.backend = backend
        # looked up once: a plugin's kernel is in the table before the run builds its model
        self.kernel = attention_kernel(backend)
        self.causal = causal

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [b, s, np, d]``, ``key``/``value [b, s_k, ng, d]`` -> context ``[b, s, np*d]``;
        ``attention_mask`` broadcast to ``[b, np, s, s_k]``: bool, True = masked; or float, added
        to the scores (T5's relative position bias, with -inf where masked)."""
        b, s = query.shape[:2]
        context = self._sdpa(query, key, value, attention_mask)
        return context.transpose(1, 2).reshape(b, s, -1)  # [b, s, np*d]

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        mask = attention_mask
        if mask is not None:
            # Megatron's bool mask is True where attention is *not* allowed; SDPA's the opposite
            mask = ~mask if mask.dtype == torch.bool else mask.to(query.dtype)
        # the kernels take [b, heads, s, d]. Query head i belongs to group i // (np/ng)
        return self.kernel.attend(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            mask,
            self.dropout_p if self.training else 0.0,
            self.causal,
        )


class KVCache:
    """The keys and values of every position seen so far, per attention layer: generation feeds
    only the new tokens and attends to these (``mega.plugins.models.gpt.generate``)."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(
        self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key``/``value [b, s_new, ng, d]``; returns all of the layer's ``[b, s, ng, d]``."""
        past = self._layers.get(id(layer))
        if past is not None:
            key, value = torch.cat((past[0], key), dim=1), torch.cat((past[1], value), dim=1)
        self._layers[id(layer)] = (key, value)
        return key, value


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, causal: bool = True) -> None:
        super().__init__()
        heads, groups = cfg.num_attention_heads, cfg.resolved_num_query_groups()
        self.head_dim = cfg.resolved_kv_channels()
        self.heads_per_group = heads // groups
        bias = cfg.add_bias_linear
        # Rows grouped like Megatron: for each group [np/ng query heads, 1 key head, 1 value head].
        qkv_rows = groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = Linear(cfg.hidden_size, qkv_rows, bias=bias or cfg.add_qkv_bias)
        # --qk-layernorm: per-head norms over d, shared by the heads (Megatron's names). Under
        # tensor parallelism each rank normalises its own heads: the weights are replicated and
        # their gradients partial sums over TP (plan.py)
        self.q_layernorm = norm_layer(cfg, self.head_dim) if cfg.qk_layernorm else None
        self.k_layernorm = norm_layer(cfg, self.head_dim) if cfg.qk_layernorm else None
        self.core_attention = CoreAttention(cfg.attention_dropout, cfg.attention_backend, causal)
        self.linear_proj = Linear(heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        per_group, d = self.heads_per_group, self.head_dim
        qkv = self.linear_qkv(hidden)
        # b and s are read from the projection, not the input: under sequence parallelism the
        # input holds s/tp positions and the column-parallel projection gathers all s of them.
        # The group count is read from the weight (-1), so a layer holding only some of the
        # groups (tensor parallel) runs unchanged.
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, per_group + 2, d)  # [b, s, ng, np/ng+2, d]
        query = qkv[:, :, :, :per_group].reshape(b, s, -1, d)  # [b, s, np, d], group-major heads
        key, value = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]  # [b, s, ng, d]
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        if kv_cache is not None:  # the mask then covers [new positions, all positions]
            key, value = kv_cache.extend(self, key, value)
        context = self.core_attention(query, key, value, attention_mask)  # [b, s, np*d]
        return self.linear_proj(context)


def key_padding_mask(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``padding_mask [b, s]`` (1 on tokens) -> the attention mask, True = masked, for keys only
    (a padded query's output, which no loss reads, averages the real positions: see
    ``mega.plugins.models.bert.model``), broadcast over heads and queries: ``[b, 1, 1, s]``.
    None (no padding) stays None, so that attention runs without a mask (flash and cuDNN kernels
    take none): the model plugin's ``prepare_microbatch`` drops a mask that masks nothing, on the
    host, where the test costs no device sync."""
    if padding_mask is None:
        return None
    return (padding_mask < 0.5)[:, None, None, :]
