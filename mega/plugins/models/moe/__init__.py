"""The ``moe`` model plugin: mega's GPT with a small Mixtral-like preset of defaults.

``mega train --model moe`` trains, with no other flag, a 4-layer decoder whose every MLP is 8
experts with top-2 routing and a load-balancing loss (RoPE, RMSNorm, SwiGLU, grouped-query
attention, untied embeddings, no biases, no dropout: Mixtral's choices at toy size). Every GPT
and MoE flag still applies (``--num-experts 16``, ``--expert-model-parallel-size 2``...): this
plugin changes defaults only; the model is the GPT's decoder and experts
(``mega.plugins.models.common.decoder``, ``mega.plugins.models.common.moe``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mega import hookimpl, option
from mega.plugins.models.common.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTConfig
from mega.plugins.models.common.decoder_spec import decoder_model_spec


@dataclass(kw_only=True)
class MoEConfig(GPTConfig):
    """GPTConfig with Mixtral-like defaults (the flags and their meaning are the GPT's)."""

    num_experts: int | None = option(8, "Experts per MoE layer.")
    moe_ffn_hidden_size: int | None = option(256, "Each expert's MLP hidden size.")
    moe_aux_loss_coeff: float = option(1e-2, "Weight of the load-balancing loss.")
    group_query_attention: bool = option(True, "Use grouped-query attention (GQA).")
    num_query_groups: int | None = option(2, "Key/value groups with --group-query-attention.")
    position_embedding_type: str = option(
        "rope", "Position embedding type.", choices=POSITION_EMBEDDING_TYPES
    )
    normalization: str = option("RMSNorm", "Normalization layer type.", choices=NORMALIZATIONS)
    swiglu: bool = option(True, "Use the gated SwiGLU MLP (--no-swiglu: GeLU).")
    untie_embeddings_and_output_weights: bool = option(
        True, "Give the output layer its own weights (--no-untie-...: tie them)."
    )
    hidden_dropout: float = option(0.0, "Dropout on embeddings and after each residual branch.")
    attention_dropout: float = option(0.0, "Dropout on the attention probabilities.")
    add_bias_linear: bool = option(
        False,
        "No biases in the linear layers (the preset has none; experts never have any).",
        flag="--disable-bias-linear",
        store=False,
    )


@hookimpl
def register_models(register) -> None:
    register(
        decoder_model_spec(
            "moe", MoEConfig, "GPT with mixture-of-experts layers (a small Mixtral-like preset)"
        )
    )
