"""A single-device BERT with Megatron-core's parameter names and initialisation.

Megatron-core's ``BertModel`` with its local layer spec: word + position (+ token-type)
embeddings; the GPT's pre-norm transformer layers, attending both ways with the padding
masked; the masked-LM head (dense, GeLU, layer norm, then the tied word embeddings plus a
bias, or with ``--untie-embeddings-and-output-weights`` an output weight of its own, as
megatron-core's ``BertModel`` has); with the binary head, a pooler (dense + tanh on position
0) and a 2-way linear.
``--bert-post-layernorm`` builds the original BERT instead (Hugging Face's ``BertModel``): a
norm on the embeddings and after each residual sum, none at the end of the encoder; megatron-
core has no such layer, so that variant is checked against transformers (the converter's test).
Shapes as in the GPT: ``b`` batch, ``s`` sequence, ``h`` hidden, ``V`` padded vocabulary.

One intended difference from Megatron: padding is masked as keys only (``[b, 1, 1, s]``), not
also as queries. A real position's output is the same either way; a padded position's output,
which no loss reads, is an average over the real ones instead of Megatron's uniform average
over everything, and the mask costs ``s`` instead of ``s x s`` booleans per sample.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from mega._deprecated import moved_apart
from mega.core.plugins.specs import BuildContext
from mega.core.training.init import on_meta
from mega.parallel.linear import Linear
from mega.parallel.weight_grad import traced
from mega.plugins.models.bert.config import BertConfig
from mega.plugins.models.common import attention as shared_attention
from mega.plugins.models.common import heads
from mega.plugins.models.common.attention import SelfAttention
from mega.plugins.models.common.checks import checked_max_positions
from mega.plugins.models.common.embedding import Embedding
from mega.plugins.models.common.heads import OutputHead
from mega.plugins.models.common.init import megatron_init_
from mega.plugins.models.common.layers import TransformerBlock
from mega.plugins.models.common.mlp import MLP
from mega.plugins.models.common.norms import norm_layer

# moved on 2026-11-28 to the parts the model families share (T5 uses them too)
__getattr__ = moved_apart(
    __name__,
    {
        "mega.plugins.models.common.attention": ["key_padding_mask"],
        "mega.plugins.models.common.heads": ["OutputBias"],
    },
    since="2026-11-28",
)


class BertEmbedding(Embedding):
    """The GPT's word and position embeddings plus Megatron's ``tokentype_embeddings``; with
    post-norm layers, a layer norm on their sum (before the dropout)."""

    def __init__(self, cfg: BertConfig, vocab_size: int, max_positions: int) -> None:
        super().__init__(cfg, vocab_size, max_positions)
        types = cfg.num_tokentypes()
        self.tokentype_embeddings = nn.Embedding(types, cfg.hidden_size) if types else None
        self.layernorm = norm_layer(cfg, cfg.hidden_size) if cfg.bert_post_layernorm else None

    def forward(self, tokens: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(tokens)  # [b, s, h]
        if self.tokentype_embeddings is not None:
            hidden = hidden + self.tokentype_embeddings(types)
        if self.layernorm is not None:
            hidden = self.layernorm(hidden)
        return self.embedding_dropout(hidden)


class PostNormLayer(nn.Module):
    """The original BERT's layer (``--bert-post-layernorm``): x = norm(x + drop(attn(x))), then
    x = norm(x + drop(mlp(x))). Built by the shared TransformerBlock in place of its pre-norm
    layer, with the same call (``rotary`` is always None here)."""

    def __init__(self, cfg: BertConfig, moe: bool = False, causal: bool = False) -> None:
        super().__init__()
        self.self_attention = SelfAttention(cfg, causal)
        self.post_attention_layernorm = norm_layer(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.post_mlp_layernorm = norm_layer(cfg, cfg.hidden_size)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attention = self.self_attention(hidden, rotary, attention_mask)
        hidden = self.post_attention_layernorm(hidden + self.hidden_dropout(attention))
        return self.post_mlp_layernorm(hidden + self.hidden_dropout(self.mlp(hidden)))


def bert_encoder(cfg: BertConfig) -> TransformerBlock:
    """The bidirectional encoder: the GPT's pre-norm block, or post-norm layers and no final
    norm (``--bert-post-layernorm``)."""
    if cfg.bert_post_layernorm:
        return TransformerBlock(cfg, causal=False, layer=PostNormLayer, final_norm=False)
    return TransformerBlock(cfg, causal=False)


class LMHead(nn.Module):
    """Megatron's ``BertLMHead``: dense, exact GeLU, layer norm (before the tied output)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden)))


def output_layer(cfg: BertConfig, vocab_size: int) -> nn.Module:
    """The masked-LM output layer's parameters, read by the head (never called): the bias
    alone when tied; untied, a ``[V, h]`` weight too, megatron-core's ``output_layer.weight``
    (a Linear so that tensor parallelism splits weight and bias by vocabulary rows together)."""
    if cfg.untie_embeddings_and_output_weights:
        return nn.Linear(cfg.hidden_size, vocab_size)  # biased whatever --disable-bias-linear
    return heads.OutputBias(vocab_size)


class FirstToken(nn.Module):
    """``[b, s, h] -> [b, h]`` at position 0 ([CLS]): what the pooler reads. Its own module so
    that sequence parallelism can gather the sequence in front of it."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0]


class Pooler(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class BertModel(nn.Module):
    """``forward(text, types, padding_mask, labels=None)``: given labels, the per-token masked-LM
    loss ``[b, s]`` (float32) and the binary logits ``[b, 2]`` (None without the binary head);
    without labels, the logits ``[b, s, V]`` and the binary logits."""

    def __init__(self, cfg: BertConfig, ctx: BuildContext) -> None:
        super().__init__()
        max_positions = checked_max_positions(cfg, ctx, "BERT")
        self.config = cfg
        self.seed = ctx.seed
        h = cfg.hidden_size
        with on_meta():  # materialised once, by reset_parameters
            self.embedding = BertEmbedding(cfg, ctx.padded_vocab_size, max_positions)
            self.encoder = bert_encoder(cfg)
            self.lm_head = LMHead(cfg)
            self.output_layer = output_layer(cfg, ctx.padded_vocab_size)
            self.output_head = OutputHead(getattr(ctx.tokenizer, "vocab_size", None))
            self.first_token = self.pooler = self.binary_head = None
            if cfg.bert_binary_head:
                self.first_token = FirstToken()
                self.pooler = Pooler(h)
                self.binary_head = Linear(h, 2)
        if ctx.device != "meta":  # a planning build (mega.core.plan): shapes, no init
            self.to_empty(device="cpu")
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init (the GPT's, ``megatron_init_``): an untied output weight is drawn
        N(0, std) from its own name, as the word embeddings it replaces."""
        cfg = self.config
        scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        megatron_init_(self, self.seed, cfg.init_method_std, lambda name: scaled_std)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, h]`` matrix that produces logits: the word embeddings when tied."""
        if self.config.untie_embeddings_and_output_weights:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        text: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        types: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        lm_positions: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``text``/``types [b, s]`` ids, ``padding_mask [b, s]`` (1 on tokens; None: no padding),
        ``labels [b, s]`` (-1 where nothing is predicted). ``lm_positions [n]``: the flat
        positions of the loss mask (the plugin's ``prepare_microbatch`` adds them); the
        masked-LM loss is then computed there only, ``[1, n]``. As a pipeline stage:
        ``hidden_states`` replaces the embeddings; a stage without the heads returns its hidden
        states."""
        attention_mask = shared_attention.key_padding_mask(padding_mask)
        if hidden_states is None:
            hidden = self.embedding(text, types=types)
        else:
            hidden = hidden_states
        hidden = self.encoder(hidden, attention_mask=attention_mask)
        if self.output_head is None:
            return hidden
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(self.pooler(self.first_token(hidden)))
        if labels is not None:
            # -1 marks unpredicted positions; any id will do there, the loss mask drops them
            labels = labels.clamp(min=0)
        weight, bias = self.output_weight(), self.output_layer.bias
        if labels is None:  # logits everywhere: positions select losses only
            lm_positions = None
        elif lm_positions is not None and not traced() and "torch._dynamo" in sys.modules:
            # how many positions are masked changes with every batch: a compiled head takes
            # their count as dynamic from its first call instead of recompiling at the second
            torch._dynamo.maybe_mark_dynamic(lm_positions, 0)
        lm = self.output_head(self.lm_head(hidden), weight, labels, bias, lm_positions)
        return lm, binary_logits
