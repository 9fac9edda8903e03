"""The BERT model plugin (``--model bert``): Megatron's BERT with its two losses.

Written as a third-party package would write it: a ModelSpec, a config of flags, a single-device
module and a parallel plan. No torch at import time.

Loss (Megatron's pretrain_bert ``loss_func``): ``lm loss``, the masked-LM cross-entropy averaged
over the masked positions of the micro-batch, plus ``sop loss``, the binary head's
cross-entropy against ``is_random`` averaged over its samples; training minimises their sum and
the iteration line prints both. ``--bert-no-binary-head`` leaves ``lm loss`` alone.
"""

from __future__ import annotations

from typing import Any

from mega import ModelSpec, hookimpl
from mega.plugins.models.bert.config import BertConfig, flops_per_token
from mega.plugins.models.bert.plan import bert_parallel_plan

__all__ = ["BertConfig", "bert_loss", "register_models", "without_full_mask"]

BATCH_KEYS = ("text", "types", "padding_mask", "labels", "loss_mask", "is_random")


def _build(cfg: BertConfig, ctx: Any):  # -> torch.nn.Module, imported lazily
    from mega.plugins.models.bert.model import BertModel

    return BertModel(cfg, ctx)


def bert_loss(output: Any, microbatch: dict[str, Any]) -> dict[str, Any]:
    """``(per-token lm loss [b, s], binary logits [b, 2] or None)`` -> the named parts."""
    import torch.nn.functional as F

    from mega.core.training.step import masked_mean

    per_token, binary_logits = output
    parts = {"lm loss": masked_mean(per_token, microbatch)}
    if binary_logits is not None:
        order = microbatch["is_random"].reshape(-1)
        parts["sop loss"] = F.cross_entropy(binary_logits.float(), order, ignore_index=-1)
    return parts


def without_full_mask(key: str) -> Any:
    """A ``prepare_microbatch`` that drops ``key`` (a padding mask, 1 on tokens) from a
    micro-batch without padding: the model then attends unmasked, on the flash or cuDNN kernels
    that take no mask, and no device-side test (a host sync per micro-batch) is needed."""

    def prepare(arrays: dict[str, Any]) -> dict[str, Any]:
        if arrays[key].all():
            return {name: values for name, values in arrays.items() if name != key}
        return arrays

    return prepare


def bert_loss_names(cfg: BertConfig) -> tuple[str, ...]:
    return ("lm loss", "sop loss") if cfg.bert_binary_head else ("lm loss",)


@hookimpl
def register_models(register) -> None:
    register(
        ModelSpec(
            name="bert",
            config_cls=BertConfig,
            build=_build,
            flops_per_token=flops_per_token,
            parallel_plan=bert_parallel_plan,
            description="BERT encoder with masked-LM and sentence-order heads (Megatron-style)",
            needs=BATCH_KEYS,
            loss=bert_loss,
            loss_names=bert_loss_names,
            default_dataset="bert",
            prepare_microbatch=without_full_mask("padding_mask"),
        )
    )
