"""The ModelSpec of a model that is mega's GPT decoder (the gpt and moe models').

Both plugins build the same ``GPTModel``, count its FLOPs and split it for parallelism the same
way; they differ only in the name, the config class (moe's is GPTConfig with other defaults)
and the description. No torch at import time: the model module is imported inside the build.
"""

from __future__ import annotations

from typing import Any

from mega.core.plugins.specs import BuildContext, ModelSpec
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.decoder_plan import gpt_parallel_plan
from mega.plugins.models.common.flops import flops_per_token


def build_decoder(cfg: GPTConfig, ctx: BuildContext) -> Any:  # a torch.nn.Module
    from mega.plugins.models.common.decoder import GPTModel

    return GPTModel(cfg, ctx)


def decoder_model_spec(name: str, config_cls: type[GPTConfig], description: str) -> ModelSpec:
    """The spec of model ``name``: the GPT decoder configured by ``config_cls``."""
    return ModelSpec(
        name=name,
        config_cls=config_cls,
        build=build_decoder,
        flops_per_token=flops_per_token,
        parallel_plan=gpt_parallel_plan,
        description=description,
    )
