"""The GPT model plugin: a decoder-only transformer with Megatron-core's names and flags.

No torch at import time: the model module is imported inside the factory, so ``mega --help`` and
``mega plugins`` stay fast.
"""

from __future__ import annotations

from mega import BuildContext, ModelSpec, hookimpl
from mega.plugins.models.gpt.config import GPTConfig, flops_per_token
from mega.plugins.models.gpt.plan import gpt_parallel_plan

__all__ = ["GPTConfig", "flops_per_token", "register_models"]


def _build(cfg: GPTConfig, ctx: BuildContext):  # -> torch.nn.Module, imported lazily
    from mega.plugins.models.gpt.model import GPTModel

    return GPTModel(cfg, ctx)


@hookimpl
def register_models(register) -> None:
    register(
        ModelSpec(
            name="gpt",
            config_cls=GPTConfig,
            build=_build,
            flops_per_token=flops_per_token,
            parallel_plan=gpt_parallel_plan,
            description="Decoder-only GPT (Megatron-style)",
        )
    )
