"""Moved on 2026-11-28 to mega.plugins.models.common: the GPT's model (``common.decoder``, which
the moe model builds too) and the layers every model family shares. The old names still work,
with a DeprecationWarning."""

from mega._deprecated import moved_apart

__getattr__ = moved_apart(
    __name__,
    {
        "mega.plugins.models.common.rotary": [
            *("LLAMA3_LOW_FREQ_FACTOR", "LLAMA3_HIGH_FREQ_FACTOR", "LLAMA3_ORIGINAL_CONTEXT"),
            *("llama3_scaled", "yarn_scaled", "rotary_cos_sin", "apply_rotary"),
        ],
        "mega.plugins.models.common.embedding": ["Embedding"],
        "mega.plugins.models.common.attention": [
            *("SDPA_KERNELS", "sdpa_backends", "CoreAttention", "KVCache", "SelfAttention"),
        ],
        "mega.plugins.models.common.mlp": ["ACTIVATIONS", "MLP"],
        "mega.plugins.models.common.layers": ["TransformerLayer", "TransformerBlock"],
        "mega.plugins.models.common.heads": ["OutputHead"],
        "mega.plugins.models.common.checks": ["checked_max_positions"],
        "mega.plugins.models.common.init": ["RESIDUAL_OUTPUTS", "megatron_init_"],
        "mega.plugins.models.common.decoder": ["GPTModel"],
        # imported here before, and so importable from here
        "mega.plugins.models.common.config": ["GPTConfig"],
        "mega.plugins.models.common.moe": ["MoELayer"],
    },
    since="2026-11-28",
)
