"""Moved on 2026-11-28 to mega.plugins.models.common (the config every model family builds on);
the old names still work, with a DeprecationWarning. The GPT plugin's own face is
``mega.plugins.models.gpt`` (``GPTConfig``, ``flops_per_token``)."""

from mega._deprecated import moved_apart

__getattr__ = moved_apart(
    __name__,
    {
        "mega.plugins.models.common.config": [
            *("POSITION_EMBEDDING_TYPES", "NORMALIZATIONS", "SCORE_FUNCTIONS"),
            *("LOAD_BALANCING_TYPES", "DROP_POLICIES", "ATTENTION_BACKENDS"),
            *("GPTConfig", "layer_pattern"),
        ],
        "mega.plugins.models.common.flops": ["flops_per_token"],
    },
    since="2026-11-28",
)
