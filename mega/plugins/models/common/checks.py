"""What a model built on the shared transformer refuses: at build time (``checked_max_positions``),
and in the config of an encoder model (``encoder_model_problems``, BERT's and T5's). No torch."""

from __future__ import annotations

from mega.core.plugins.specs import BuildContext
from mega.plugins.models.common.config import GPTConfig


def checked_max_positions(
    cfg: GPTConfig, ctx: BuildContext, model: str, lengths: dict[str, int] | None = None
) -> int:
    """What a model built on the GPT's config and layers (GPT, BERT, T5) refuses at build time:
    its config's problems, a context without the padded vocabulary, cuDNN attention off a GPU,
    a sequence longer than the learned position table. Returns that table's size. ``lengths``:
    flag -> positions the table must cover (default ``--seq-length``)."""
    problems = cfg.validate()
    if problems:
        raise ValueError(f"invalid {model} config: " + "; ".join(problems))
    if ctx.padded_vocab_size <= 0:
        raise ValueError("BuildContext.padded_vocab_size must be set before building the model")
    if cfg.attention_backend == "fused" and ctx.device != "cuda":
        raise ValueError(
            "--attention-backend fused is cuDNN's attention and needs a CUDA GPU; "
            "use flash, unfused or auto on the CPU"
        )
    max_positions = cfg.resolved_max_position_embeddings(ctx.seq_length)
    if cfg.position_embedding_type == "learned_absolute":
        for flag, length in (lengths or {"--seq-length": ctx.seq_length}).items():
            if length > max_positions:
                raise ValueError(
                    f"{flag} ({length}) exceeds --max-position-embeddings ({max_positions})"
                )
    return max_positions


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
