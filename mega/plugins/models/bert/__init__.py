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
from mega._deprecated import moved
from mega.plugins.models.bert.config import BertConfig, flops_per_token
from mega.plugins.models.bert.plan import bert_parallel_plan
from mega.plugins.models.common import batches

__all__ = ["BertConfig", "bert_loss", "register_models"]

# moved on 2026-11-28 to the parts the model families share (T5 drops its mask with it too)
__getattr__ = moved(
    __name__, "mega.plugins.models.common.batches", ["without_full_mask"], since="2026-11-28"
)

BATCH_KEYS = ("text", "types", "padding_mask", "labels", "loss_mask", "is_random")


def _build(cfg: BertConfig, ctx: Any):  # -> torch.nn.Module, imported lazily
    from mega.plugins.models.bert.model import BertModel

    return BertModel(cfg, ctx)


def bert_loss(output: Any, microbatch: dict[str, Any]) -> dict[str, Any]:
    """``(per-token lm loss [b, s], binary logits [b, 2] or None)`` -> the named parts."""
    import torch.nn.functional as F

    from mega.core.training.step import masked_mean

    per_token, binary_logits = output
    positions = microbatch.get("lm_positions")
    if positions is None:
        parts = {"lm loss": masked_mean(per_token, microbatch)}
    else:  # the loss at the loss mask's positions only: the same mean
        mask = microbatch["loss_mask"]
        weights = mask.flatten().index_select(0, positions).to(per_token.dtype)
        parts = {"lm loss": (per_token.flatten() * weights).sum() / mask.sum().clamp(min=1.0)}
    if binary_logits is not None:
        order = microbatch["is_random"].reshape(-1)
        parts["sop loss"] = F.cross_entropy(binary_logits.float(), order, ignore_index=-1)
    return parts


def with_lm_positions(arrays: dict[str, Any]) -> dict[str, Any]:
    """A ``prepare_microbatch`` step: ``lm_positions``, the flat indices of the loss mask's
    positions (about 15% of a BERT micro-batch), so that the masked-LM head's vocabulary-sized
    product and cross-entropy run on those alone. On the host: the count is known there for
    free. A micro-batch that predicts nothing keeps the whole-sequence path."""
    import numpy as np

    positions = np.flatnonzero(arrays["loss_mask"].reshape(-1))
    if positions.size:
        arrays = {**arrays, "lm_positions": positions.astype(np.int64)}
    return arrays


_without_full_padding = batches.without_full_mask("padding_mask")


def bert_prepare_microbatch(arrays: dict[str, Any]) -> dict[str, Any]:
    return with_lm_positions(_without_full_padding(arrays))


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
            prepare_microbatch=bert_prepare_microbatch,
        )
    )
