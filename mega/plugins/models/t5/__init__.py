"""The T5 model plugin (``--model t5``): Megatron's encoder-decoder, trained on span corruption.

Written as a third-party package would write it: a ModelSpec, a config of flags, a single-device
module and a parallel plan. No torch at import time. The loss is the language-model default:
the decoder's per-token cross-entropy averaged over ``loss_mask`` (``lm loss``).
"""

from __future__ import annotations

from typing import Any

from mega import ModelSpec, hookimpl
from mega.plugins.models.common.batches import without_full_mask
from mega.plugins.models.t5.config import T5Config, flops_per_token
from mega.plugins.models.t5.plan import t5_parallel_plan

__all__ = ["T5Config", "register_models"]

BATCH_KEYS = ("text_enc", "text_dec", "enc_mask", "labels", "loss_mask")


def _build(cfg: T5Config, ctx: Any):  # -> torch.nn.Module, imported lazily
    from mega.plugins.models.t5.model import T5Model

    return T5Model(cfg, ctx)


@hookimpl
def register_models(register) -> None:
    register(
        ModelSpec(
            name="t5",
            config_cls=T5Config,
            build=_build,
            flops_per_token=flops_per_token,
            parallel_plan=t5_parallel_plan,
            description="T5 encoder-decoder with cross-attention (Megatron-style)",
            needs=BATCH_KEYS,
            default_dataset="t5",
            prepare_microbatch=without_full_mask("enc_mask"),
        )
    )
