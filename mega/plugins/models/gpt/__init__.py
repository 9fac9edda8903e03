"""The GPT model plugin: a decoder-only transformer with Megatron-core's names and flags.

The model, its config and its parallel plan live in ``mega.plugins.models.common`` (the moe
model builds the same decoder); this package registers them as ``gpt`` and holds what only the
GPT has: its build-time checks of a run and text generation (``generate``).

No torch at import time: the model module is imported inside the factory, so ``mega --help`` and
``mega plugins`` stay fast.
"""

from __future__ import annotations

from mega import hookimpl
from mega.core.config.run_checks import runs_on_cpu
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.decoder_spec import build_decoder, decoder_model_spec
from mega.plugins.models.common.flops import flops_per_token

__all__ = ["GPTConfig", "flops_per_token", "register_models", "validate_config"]

_build = build_decoder  # the name tests and callers have used for the GPT's build


@hookimpl
def register_models(register) -> None:
    register(decoder_model_spec("gpt", GPTConfig, "Decoder-only GPT (Megatron-style)"))


@hookimpl
def validate_config(config) -> list[str]:
    """What the GPT model would refuse at build time, found with every other config problem."""
    if not isinstance(config.model, GPTConfig):  # the gpt model, or one built on it (moe)
        return []
    seq_length = config.training.seq_length
    max_positions = config.model.max_position_embeddings
    problems = []
    if (
        config.model.position_embedding_type == "learned_absolute"
        and max_positions is not None
        and seq_length > max_positions
    ):
        problems.append(
            f"--seq-length ({seq_length}) exceeds --max-position-embeddings ({max_positions})"
        )
    if (
        config.model.attention_backend == "flash"
        and config.model.attention_dropout > 0
        and runs_on_cpu(config.training.device)
    ):
        # PyTorch's CPU flash kernel has no dropout: SDPA would fail at the first step
        problems.append(
            "--attention-backend flash (--use-flash-attn) on the CPU needs --attention-dropout 0"
            " (PyTorch's CPU flash attention has no dropout)"
        )
    return problems
