"""A single-device T5 with Megatron-core's parameter names and initialisation.

Megatron-core's ``T5Model`` with its local layer specs: one embedding (word + learned position)
for both stacks; the encoder is the GPT's pre-norm layers attending both ways with the padding
masked; each decoder layer adds cross-attention (``linear_q`` from the decoder, ``linear_kv``
from the encoder's output, rows ``[k; v]`` per head) between its causal self-attention and its
MLP; each stack ends in a layer norm; the LM head is the tied word embeddings plus a bias.

Megatron-core 0.16.1's *local* block specs name ``TENorm`` for the stacks' final norms, which is
None without Transformer Engine, so a CPU megatron-core T5 silently has no final norms; every
GPU run (with Transformer Engine) has them, and so does this model (the oracle test builds
megatron-core's blocks with a torch norm there). Padding is masked as keys only, as in mega's
BERT; the decoder needs no padding mask (its padding comes after every real position).

The original T5's architecture (what Hugging Face's ``T5ForConditionalGeneration`` holds) is
these flags: ``--position-embedding-type relative`` (a bias per head and distance bucket, one
table per stack, added to the self-attention scores; megatron-core's local layers cannot add
it), ``--normalization RMSNorm``, ``--relu``, ``--disable-bias-linear``. The last also drops
the LM head's bias, which megatron-core keeps whenever the output is tied: T5 has none.
T5's unscaled attention scores and its ``d_model^-0.5`` on the tied output are folded into the
weights by the converter (``mega.plugins.convert.hf_t5``), not built here.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mega.core.plugins.specs import BuildContext
from mega.core.training.init import on_meta
from mega.parallel.linear import Linear
from mega.plugins.models.common.attention import CoreAttention, SelfAttention, key_padding_mask
from mega.plugins.models.common.checks import checked_max_positions
from mega.plugins.models.common.embedding import Embedding
from mega.plugins.models.common.heads import OutputBias, OutputHead
from mega.plugins.models.common.init import megatron_init_
from mega.plugins.models.common.layers import TransformerBlock
from mega.plugins.models.common.mlp import MLP
from mega.plugins.models.common.norms import norm_layer
from mega.plugins.models.t5.config import T5Config
from mega.plugins.models.t5.relative_position import RelativePositionBias


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder's output."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.head_dim = d = cfg.resolved_kv_channels()
        projection = cfg.num_attention_heads * d
        bias = cfg.add_bias_linear
        self.linear_q = Linear(cfg.hidden_size, projection, bias=bias)
        self.linear_kv = Linear(cfg.hidden_size, 2 * projection, bias=bias)  # [k; v] per head
        self.core_attention = CoreAttention(
            cfg.attention_dropout, cfg.attention_backend, causal=False
        )
        self.linear_proj = Linear(projection, cfg.hidden_size, bias=bias)

    def forward(
        self, hidden: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None
    ) -> torch.Tensor:
        d = self.head_dim
        query = self.linear_q(hidden)
        kv = self.linear_kv(context)
        # sizes read from the projections: under sequence parallelism they gathered the sequence
        query = query.view(*query.shape[:2], -1, d)  # [b, sd, np, d]
        key, value = kv.view(*kv.shape[:2], -1, 2 * d).split(d, dim=-1)  # [b, se, np, d] each
        return self.linear_proj(self.core_attention(query, key, value, context_mask))


class DecoderLayer(nn.Module):
    """x + self-attention (causal), x + cross-attention, x + MLP; each after its own norm."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.input_layernorm = norm_layer(cfg, cfg.hidden_size)
        self.self_attention = SelfAttention(cfg, causal=True)
        self.pre_cross_attn_layernorm = norm_layer(cfg, cfg.hidden_size)
        self.cross_attention = CrossAttention(cfg)
        self.pre_mlp_layernorm = norm_layer(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``attention_mask``: None (causal), or the self-attention's float mask (the relative
        position bias, -inf above the diagonal)."""
        attention = self.self_attention(self.input_layernorm(hidden), None, attention_mask)
        hidden = hidden + self.hidden_dropout(attention)
        cross = self.cross_attention(self.pre_cross_attn_layernorm(hidden), context, context_mask)
        hidden = hidden + self.hidden_dropout(cross)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = norm_layer(cfg, cfg.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, context, context_mask, attention_mask)
        return self.final_layernorm(hidden)


def with_relative_bias(
    bias: RelativePositionBias | None,
    length: int,
    mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor | None:
    """A stack's self-attention mask: with relative positions, the bias ``[1, np, s, s]``
    with -inf where ``mask`` (bool ``[b, 1, 1, s]``, True = masked) or the causal triangle
    hides a key; without, ``mask`` as it is (None: causal or all keys, by the stack)."""
    if bias is None:
        return mask
    scores = bias(length, length)
    hidden = mask
    if causal:
        above = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
        hidden = above if mask is None else above | mask
    if hidden is None:
        return scores
    return torch.where(hidden, float("-inf"), scores)  # [b or 1, np, s, s]


class LMHead(nn.Module):
    """Megatron-core's ``T5LMHead``: here only its output layer's bias (the weight is tied)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.output_layer = OutputBias(vocab_size)


def _relative_bias(cfg: T5Config, bidirectional: bool) -> RelativePositionBias:
    return RelativePositionBias(
        cfg.num_attention_heads,
        cfg.relative_attention_num_buckets,
        cfg.relative_attention_max_distance,
        bidirectional,
    )


class T5Model(nn.Module):
    """``forward(text_enc, text_dec, enc_mask, labels=None)``: given labels, the per-token loss
    ``[b, sd]`` (float32) over the decoder positions; else the logits ``[b, sd, V]``."""

    def __init__(self, cfg: T5Config, ctx: BuildContext) -> None:
        super().__init__()
        lengths = {"--seq-length": ctx.seq_length, "--decoder-seq-length": cfg.decoder_seq_length}
        max_positions = checked_max_positions(cfg, ctx, "T5", lengths)
        self.config = cfg
        self.seed = ctx.seed
        with on_meta():  # materialised once, by reset_parameters
            self.embedding = Embedding(cfg, ctx.padded_vocab_size, max_positions)
            self.encoder_relative_pos_emb = self.decoder_relative_pos_emb = None
            if cfg.position_embedding_type == "relative":
                self.encoder_relative_pos_emb = _relative_bias(cfg, bidirectional=True)
                self.decoder_relative_pos_emb = _relative_bias(cfg, bidirectional=False)
            self.encoder = TransformerBlock(cfg.stack(cfg.resolved_encoder_layers()), causal=False)
            self.decoder = DecoderBlock(cfg.stack(cfg.resolved_decoder_layers()))
            # --disable-bias-linear drops this bias too, unlike Megatron (module docstring)
            self.lm_head = LMHead(ctx.padded_vocab_size) if cfg.add_bias_linear else None
            self.output_head = OutputHead(getattr(ctx.tokenizer, "vocab_size", None))
        if ctx.device != "meta":  # a planning build (mega.core.plan): shapes, no init
            self.to_empty(device="cpu")
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init (the GPT's, ``megatron_init_``); a residual output's std is scaled by
        the layers of its own stack, as megatron-core scales by each stack's config."""
        cfg = self.config
        std = cfg.init_method_std
        stacks = {
            "encoder": std / math.sqrt(2.0 * cfg.resolved_encoder_layers()),
            "decoder": std / math.sqrt(2.0 * cfg.resolved_decoder_layers()),
        }
        megatron_init_(self, self.seed, std, lambda name: stacks[name.partition(".")[0]])

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        text_enc: torch.Tensor,
        text_dec: torch.Tensor,
        enc_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``text_enc [b, se]``, ``text_dec [b, sd]`` ids; ``enc_mask [b, se]`` 1 on the encoder's
        tokens (None: no padding); ``labels [b, sd]`` (-1 on padding)."""
        # padded encoder positions, as keys, for the encoder and the cross-attention
        padding = key_padding_mask(enc_mask)
        # the sequence lengths of the inputs: under sequence parallelism the stacks hold parts
        encoder_mask = with_relative_bias(
            self.encoder_relative_pos_emb, text_enc.shape[1], padding, causal=False
        )
        decoder_mask = with_relative_bias(
            self.decoder_relative_pos_emb, text_dec.shape[1], None, causal=True
        )
        context = self.encoder(self.embedding(text_enc), attention_mask=encoder_mask)
        hidden = self.decoder(self.embedding(text_dec), context, padding, decoder_mask)
        if labels is not None:
            labels = labels.clamp(min=0)  # -1 on padding: the loss mask drops those positions
        bias = None if self.lm_head is None else self.lm_head.output_layer.bias
        return self.output_head(hidden, self.output_weight(), labels, bias)
