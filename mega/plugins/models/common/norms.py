"""The normalisation layer a config asks for (--normalization, --norm-epsilon), built the same
way by every model family's layers, embeddings and heads."""

from __future__ import annotations

from torch import nn

from mega.plugins.models.common.config import GPTConfig


def norm_layer(cfg: GPTConfig, size: int) -> nn.Module:
    # Megatron's LayerNorm always has a bias, whatever --disable-bias-linear says; RMSNorm has none.
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=cfg.norm_epsilon)
    return nn.LayerNorm(size, eps=cfg.norm_epsilon)
