"""Rotary position embeddings (RoPE): the cos/sin tables, with Llama 3's and YaRN's frequency
scaling and linear interpolation, and the rotation of queries and keys (Megatron's rotate-half).
Shared by every stack of the GPT-style transformer layers."""

from __future__ import annotations

import math

import torch

from mega.plugins.models.common.config import GPTConfig

# Llama 3's RoPE scaling constants, fixed in Megatron (and in every Llama 3.1/3.2 checkpoint)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3's frequency scaling (Megatron's ``_apply_scaling``, transformers' ``llama3``):
    wavelengths longer than the original context / low factor are divided by ``factor``,
    those shorter than it / high factor kept, the band between blended smoothly."""
    low, high, context = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def yarn_scaled(inv_freq: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and cos/sin scale (Megatron's YarnRotaryEmbedding, transformers'
    ``yarn``): a linear ramp over the head dim blends the original frequencies (kept where they
    rotate fast) with them divided by the factor (where they rotate slowly)."""
    factor, base = cfg.yarn_rotary_scaling_factor, cfg.rotary_base
    dim, context = 2 * inv_freq.shape[0], cfg.yarn_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)  # fmt: skip
    kept = 1.0 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    scaled = inv_freq / factor * (1 - kept) + inv_freq * kept

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return scaled, mscale(cfg.yarn_mscale) / mscale(cfg.yarn_mscale_all_dim)


def rotary_cos_sin(
    seq_length: int,
    dim: int,
    base: float,
    device: torch.device | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    llama3_factor: float | None = None,
    interpolation: float | None = None,
    yarn: GPTConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in float32 for Megatron's non-interleaved (rotate-half) RoPE: ``[s, d]`` for
    positions 0..s-1, or ``[b, s, d]`` for explicit ``position_ids [b, s]``. ``llama3_factor``:
    --use-rope-scaling's frequencies; ``interpolation``: positions divided by it (linear
    scaling, --rotary-seq-len-interpolation-factor); ``yarn``: the config of
    --position-embedding-type yarn (cos and sin come scaled)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if llama3_factor is not None:
        inv_freq = llama3_scaled(inv_freq, llama3_factor)
    concentration = 1.0
    if yarn is not None:
        inv_freq, concentration = yarn_scaled(inv_freq, yarn)
    if position_ids is None:
        positions = torch.arange(seq_length, dtype=torch.float32, device=device)
    else:
        positions = position_ids.to(torch.float32)
    if interpolation is not None:
        positions = positions * (1 / interpolation)  # as Megatron: seq *= 1 / factor
    freqs = positions[..., None] * inv_freq  # [s, d/2] or [b, s, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [s, d]: both halves share a frequency
    if concentration != 1.0:  # yarn's attention factor, on cos and sin (as Megatron)
        return angles.cos() * concentration, angles.sin() * concentration
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, s, heads, d]`` by position; cos/sin ``[s, d]`` or ``[b, s, d]`` are cast to
    x's dtype (Megatron)."""
    cos = cos.unsqueeze(-2).to(x.dtype)  # [s, 1, d] or [b, s, 1, d]: broadcast over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
