"""Training FLOPs per token of the GPT-style transformer (the gpt and moe models' count; BERT's
adds its head to it). No torch. Its own module so the families share one formula."""

from __future__ import annotations

from mega.plugins.models.common.config import GPTConfig


def flops_per_token(cfg: GPTConfig, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward), Megatron/PaLM style.

    ``6 * N + 12 * L * (np * d) * s``, where

    * ``N`` counts the matmul weights one token passes through: per layer
      ``h*(np*d + 2*ng*d)`` (QKV) + ``np*d*h`` (proj) + ``h*f*g`` (fc1, ``g`` = 2 with SwiGLU)
      + ``f*h`` (fc2), times ``L`` layers, plus the output projection ``h*V`` once (tied or not).
      A MoE layer counts its router ``h*E`` and, instead of the MLP, the ``k`` experts a token
      goes through (``--moe-ffn-hidden-size``) and the shared expert: active parameters.
      Biases, norms and the embedding lookups (word and position) are excluded: they are not
      matmuls. ``6 = 2`` (multiply-add) ``* 3`` (forward, input grad, weight grad).
    * ``12 * L * (np*d) * s`` is attention itself: ``Q @ K^T`` and ``P @ V`` are ``2 * 2 * np*d*s``
      FLOPs per token forward, times 3 for training. The causal mask is not discounted (as in
      Megatron's and PaLM's accounting).

    ``h`` hidden, ``np`` heads, ``ng`` query groups, ``d`` kv channels, ``f`` ffn hidden,
    ``L`` layers, ``s`` sequence length, ``V`` padded vocab.
    """
    h, layers = cfg.hidden_size, cfg.num_layers
    heads, groups = cfg.num_attention_heads, cfg.resolved_num_query_groups()
    d, ffn = cfg.resolved_kv_channels(), cfg.resolved_ffn_hidden_size()
    gate = 2 if cfg.swiglu else 1
    attention_params = h * (heads * d + 2 * groups * d) + heads * d * h
    dense = (gate + 1) * h * ffn
    # a MoE layer: the router, then the top-k experts' MLPs (and the shared expert) per token
    expert = (gate + 1) * h * cfg.resolved_moe_ffn_hidden_size() if cfg.num_experts else 0
    shared = (gate + 1) * h * (cfg.moe_shared_expert_intermediate_size or 0)
    moe = h * (cfg.num_experts or 0) + cfg.moe_router_topk * expert + shared
    mlps = sum(moe if is_moe else dense for is_moe in cfg.moe_layers())
    matmul_params = layers * attention_params + mlps + h * padded_vocab_size
    attention = 12 * layers * heads * d * seq_length
    return float(6 * matmul_params + attention)
