"""BERT model config: the GPT's transformer flags plus BERT's own, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from mega._deprecated import moved
from mega.core.config.fields import option
from mega.plugins.models.common import checks
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.flops import flops_per_token as decoder_flops_per_token

# moved on 2026-11-28 to the parts the model families share (T5 checks its config with it too)
__getattr__ = moved(
    __name__, "mega.plugins.models.common.checks", ["encoder_model_problems"], since="2026-11-28"
)


@dataclass(kw_only=True)
class BertConfig(GPTConfig):
    """Megatron's BERT: a bidirectional GPT-style (pre-norm, or with --bert-post-layernorm the
    original post-norm) encoder with BERT's heads.

    Every transformer flag is the GPT's (``--num-layers``, ``--hidden-size``...), with the same
    defaults; mixture-of-experts flags are refused (Megatron's BERT has no MoE layer spec).
    """

    bert_binary_head: bool = option(
        True,
        "Drop the binary (sentence-order) head, its pooler and the token-type embeddings; the "
        "bert dataset then makes single segments (Megatron's --bert-no-binary-head).",
        flag="--bert-no-binary-head",
        store=False,
    )

    bert_post_layernorm: bool = option(
        False,
        "Post-norm layers: a layer norm on the embeddings and after each residual sum, none at "
        "the end of the encoder (the original BERT's, Hugging Face's BertModel); Megatron's BERT "
        "normalises before each sub-layer.",
    )

    def num_tokentypes(self) -> int:
        """Megatron's pretrain_bert: segment A/B embeddings only with the binary head."""
        return 2 if self.bert_binary_head else 0

    def validate(self) -> list[str]:
        return super().validate() + checks.encoder_model_problems(self, "bert")


def flops_per_token(cfg: BertConfig, seq_length: int, padded_vocab_size: int) -> float:
    """The GPT's count (layers, attention, the output projection) plus the masked-LM head's
    ``h x h`` dense, both as Megatron counts: every position, forward and backward. The pooler
    and binary head run once per sample and are left out."""
    dense = 6 * cfg.hidden_size * cfg.hidden_size
    return decoder_flops_per_token(cfg, seq_length, padded_vocab_size) + dense
