"""Moved on 2026-11-28 to mega.plugins.models.common: the decoder's plan (``common.decoder_plan``,
the moe model's too) and the plan pieces every model family uses (``common.plan``). The old names
still work, with a DeprecationWarning."""

from mega._deprecated import moved_apart

__getattr__ = moved_apart(
    __name__,
    {
        "mega.plugins.models.common.decoder_plan": [
            *("LAYERS", "CORE_ATTENTION", "TIED_WEIGHT", "VOCAB_PARAMETERS", "gpt_parallel_plan"),
        ],
        "mega.plugins.models.common.plan": [
            *("EMBEDDING_STYLES", "layer_styles", "hidden_shape", "tensor_parallel_problems"),
        ],
        "mega.plugins.models.common.config": ["GPTConfig"],  # imported here before
    },
    since="2026-11-28",
)
