"""T5 model config: the GPT's transformer flags plus T5's stack sizes, importable without torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from mega.core.config.fields import option
from mega.plugins.datasets.t5 import DEFAULT_DECODER_SEQ_LENGTH  # noqa: E402  one default
from mega.plugins.models.common.checks import encoder_model_problems
from mega.plugins.models.common.config import GPTConfig

# Megatron's T5 positions: a learned table, or T5's bucketed relative bias per head
T5_POSITION_EMBEDDINGS = ("learned_absolute", "relative")


@dataclass(kw_only=True)
class T5Config(GPTConfig):
    """Megatron's T5: a bidirectional encoder and a causal decoder with cross-attention, both
    with the GPT's pre-norm layers, sharing one embedding (words and learned positions, or
    the original T5's relative position bias)."""

    POSITION_EMBEDDINGS: ClassVar[tuple[str, ...]] = T5_POSITION_EMBEDDINGS

    position_embedding_type: str = option(
        "learned_absolute",
        "Position embedding type: a learned table, or relative (the original T5's: a learned"
        " bias per attention head and bucket of key-query distance, one table per stack).",
        choices=T5_POSITION_EMBEDDINGS,
    )
    relative_attention_num_buckets: int = option(
        32, "Distance buckets of --position-embedding-type relative."
    )
    relative_attention_max_distance: int = option(
        128, "Distance from which --position-embedding-type relative's buckets stop growing."
    )
    relu: bool = option(
        False, "ReLU in the MLPs instead of GeLU (the original T5's, Hugging Face's default)."
    )

    encoder_num_layers: int | None = option(None, "Encoder layers (default: --num-layers).")
    decoder_num_layers: int | None = option(None, "Decoder layers (default: --num-layers).")
    decoder_seq_length: int = option(
        DEFAULT_DECODER_SEQ_LENGTH,
        "Decoder positions per sample (the encoder's are --seq-length / --encoder-seq-length).",
    )

    def stack(self, layers: int) -> GPTConfig:
        """This config for one stack of ``layers`` layers (what the GPT's blocks read)."""
        return dataclasses.replace(self, num_layers=layers)

    def mlp_activation(self) -> str:
        if self.relu:
            return "relu"
        return super().mlp_activation()

    def resolved_encoder_layers(self) -> int:
        return self.encoder_num_layers or self.num_layers

    def resolved_decoder_layers(self) -> int:
        return self.decoder_num_layers or self.num_layers

    def resolved_max_position_embeddings(self, seq_length: int) -> int:
        """One position table serves both stacks: it covers the longer one."""
        return self.max_position_embeddings or max(seq_length, self.decoder_seq_length)

    def validate(self) -> list[str]:
        problems = super().validate() + encoder_model_problems(self, "t5")
        for name in ("encoder_num_layers", "decoder_num_layers"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"--{name.replace('_', '-')} ({value}) must be positive")
        if self.decoder_seq_length <= 0:
            problems.append(f"--decoder-seq-length ({self.decoder_seq_length}) must be positive")
        for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
            if getattr(self, name) <= 0:
                problems.append(
                    f"--{name.replace('_', '-')} ({getattr(self, name)}) must be positive"
                )
        if self.relu and (self.swiglu or self.openai_gelu):
            problems.append("--relu with --swiglu or --openai-gelu: give one activation")
        if self.group_query_attention:  # Megatron's cross-attention has one key/value per head
            problems.append("--group-query-attention: the t5 model's attention has no groups")
        if self.untie_embeddings_and_output_weights:  # Megatron's pretrain_t5 ties them
            problems.append(
                "--untie-embeddings-and-output-weights: the t5 model's output layer always"
                " reuses the word embeddings (as in Megatron)"
            )
        return problems


def flops_per_token(cfg: T5Config, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per *encoder* token (mega's tokens/s counts ``--seq-length`` positions).

    A sample's FLOPs, divided by the encoder length ``se``: the encoder's layers over ``se``
    positions; the decoder's layers (self-attention, the cross-attention's query and output
    projections, the MLP) and the output projection over ``sd`` positions; the
    cross-attention's key/value projection over ``se`` positions per decoder layer; attention
    scores and sums ``12 x d_attn x (se x se)`` per encoder layer, ``(sd x sd + sd x se)`` per
    decoder layer (no causal discount, as in Megatron's accounting). ``6 = 2 x 3`` as in the GPT.
    """
    h, se, sd = cfg.hidden_size, seq_length, cfg.decoder_seq_length
    attn = cfg.num_attention_heads * cfg.resolved_kv_channels()  # np * d
    ffn = cfg.resolved_ffn_hidden_size()
    mlp = (3 if cfg.swiglu else 2) * h * ffn
    self_attention = 4 * h * attn  # qkv (3) + proj (1)
    le, ld = cfg.resolved_encoder_layers(), cfg.resolved_decoder_layers()
    encoder = le * (6 * (self_attention + mlp) * se + 12 * attn * se * se)
    cross_q_proj = 2 * h * attn
    decoder = ld * (
        6 * (self_attention + cross_q_proj + mlp) * sd
        + 6 * 2 * h * attn * se  # cross-attention keys and values, over the encoder positions
        + 12 * attn * (sd * sd + sd * se)
    )
    head = 6 * h * padded_vocab_size * sd
    return float(encoder + decoder + head) / se
