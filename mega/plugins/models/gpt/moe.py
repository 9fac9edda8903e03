"""Moved on 2026-11-28 to mega.plugins.models.common.moe (the gpt and moe models' experts, built
by the shared transformer layer). The old names still work, with a DeprecationWarning."""

from mega._deprecated import moved_apart

__getattr__ = moved_apart(
    __name__,
    {
        "mega.plugins.models.common.moe": [
            *("Routing", "RouterStats", "Router", "sinkhorn", "StackedLinear"),
            *("GroupedExperts", "LocalDispatcher", "MoELayer"),
        ],
        "mega.plugins.models.common.config": ["GPTConfig"],  # imported here before
    },
    since="2026-11-28",
)
