"""BERT model config: the GPT's transformer flags plus BERT's own, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config.fields import option
from mega.plugins.models.gpt.config import GPTConfig
from mega.plugins.models.gpt.config import flops_per_token as decoder_flops_per_token


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
        return super().validate() + encoder_model_problems(self, "bert")


def encoder_model_problems(cfg: GPTConfig, model: str) -> list[str]:
    """What BERT and T5 refuse of the GPT's flags. (--untie-embeddings-and-output-weights is
    BERT's, as megatron-core's BertModel takes it; T5 refuses it itself.)"""
    problems = []
    if cfg.num_experts:
        problems.append(
            f"--num-experts: the {model} model has no mixture-of-experts layers (use gpt or moe)"
        )
    gpt_only = (
        ("--add-qkv-bias", cfg.add_qkv_bias),
        ("--qk-layernorm", cfg.qk_layernorm),
        ("--use-rope-scaling", cfg.use_rope_scaling),
        ("--rotary-seq-len-interpolation-factor", cfg.rotary_seq_len_interpolation_factor),
        ("--position-embedding-type yarn", cfg.position_embedding_type == "yarn"),
    )
    for flag, value in gpt_only:
        if value:
            problems.append(f"{flag}: a GPT (decoder) option; the {model} model has none")
    return problems


def flops_per_token(cfg: BertConfig, seq_length: int, padded_vocab_size: int) -> float:
    """The GPT's count (layers, attention, the output projection) plus the masked-LM head's
    ``h x h`` dense, both as Megatron counts: every position, forward and backward. The pooler
    and binary head run once per sample and are left out."""
    dense = 6 * cfg.hidden_size * cfg.hidden_size
    return decoder_flops_per_token(cfg, seq_length, padded_vocab_size) + dense
