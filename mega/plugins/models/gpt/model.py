"""A single-device GPT with Megatron-core's parameter names and initialisation.

Shapes: ``b`` batch, ``s`` sequence, ``h`` hidden, ``np`` query heads, ``ng`` query groups (key/value
heads), ``d`` head dim (kv channels), ``f`` ffn hidden, ``V`` padded vocab. Activations are kept
batch-first ``[b, s, h]``. No process groups here: parallel plugins rewrite this module from outside,
keyed on the parameter names below and on the module paths of ``plan.py``. Two parameter-free
submodules exist for them: ``core_attention`` (the SDPA call: wrapped to run under the
tensor-parallel RNG, or recomputed) and ``output_head`` (hidden states x output weight -> logits or
loss: swapped for a vocab-parallel head).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mega.core.plugins.specs import BuildContext
from mega.core.training.init import normal_, on_meta
from mega.parallel.fp8.delayed import sites_of
from mega.parallel.fp8.mlp import fp8_gelu_mlp, fuses_gelu_mlp
from mega.parallel.linear import Linear
from mega.parallel.positions import at_positions
from mega.plugins.models.gpt.config import GPTConfig
from mega.plugins.models.gpt.moe import MoELayer


def _norm(cfg: GPTConfig, size: int) -> nn.Module:
    # Megatron's LayerNorm always has a bias, whatever --disable-bias-linear says; RMSNorm has none.
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=cfg.norm_epsilon)
    return nn.LayerNorm(size, eps=cfg.norm_epsilon)


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


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig, vocab_size: int, max_positions: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, cfg.hidden_size)  # [V, h]
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(max_positions, cfg.hidden_size)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.embedding_dropout(self.embed(tokens, position_ids))

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Word plus position embeddings ``[b, s, h]``, before the dropout (a subclass adds
        its own embeddings there: BERT's token types)."""
        hidden = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            seq_length = tokens.shape[1]
            if seq_length > self.position_embeddings.num_embeddings:
                raise ValueError(
                    f"sequence length {seq_length} exceeds --max-position-embeddings "
                    f"({self.position_embeddings.num_embeddings})"
                )
            if position_ids is None:
                hidden = hidden + self.position_embeddings.weight[:seq_length][None]
            else:  # [b, s]: positions restart after each document with --reset-position-ids
                hidden = hidden + self.position_embeddings(position_ids)
        return hidden


# --attention-backend (Megatron's names) -> the SDPA kernels allowed. "fused" is cuDNN's fused
# attention (what Megatron reaches through Transformer Engine), "unfused" the plain math of
# softmax(QK^T)V; "auto" leaves the choice to PyTorch, which on Hopper picks cuDNN (torch 2.11).
SDPA_KERNELS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION],
    "unfused": [SDPBackend.MATH],
}


def sdpa_backends(backend: str) -> contextlib.AbstractContextManager:
    """The context that makes SDPA use the kernels ``--attention-backend`` names."""
    if backend in SDPA_KERNELS:
        return sdpa_kernel(SDPA_KERNELS[backend])
    return contextlib.nullcontext()


class CoreAttention(nn.Module):
    """Scaled dot-product attention with causal or explicit masking; no parameters.

    Its own module so that parallel plugins can run it under another RNG (its dropout acts on
    tensor-parallel-sharded heads) or recompute it in backward (selective recompute).
    ``causal``: with no explicit mask, each position sees those up to itself (a decoder); else
    every position (an encoder: BERT's, T5's, and cross-attention).
    """

    def __init__(self, dropout_p: float, backend: str = "auto", causal: bool = True) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.backend = backend
        self.causal = causal

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [b, s, np, d]``, ``key``/``value [b, s_k, ng, d]`` -> context ``[b, s, np*d]``;
        ``attention_mask`` broadcast to ``[b, np, s, s_k]``: bool, True = masked; or float, added
        to the scores (T5's relative position bias, with -inf where masked)."""
        b, s, heads, _ = query.shape
        with sdpa_backends(self.backend):
            context = self._sdpa(query, key, value, attention_mask)
        return context.transpose(1, 2).reshape(b, s, -1)  # [b, s, np*d]

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        heads = query.shape[2]
        mask = attention_mask
        if mask is not None:
            # Megatron's bool mask is True where attention is *not* allowed; SDPA's the opposite
            mask = ~mask if mask.dtype == torch.bool else mask.to(query.dtype)
        # SDPA wants [b, heads, s, d]. Query head i belongs to group i // (np/ng), which is exactly
        # the repeat_interleave that enable_gqa applies to key/value heads.
        return F.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=attention_mask is None and self.causal,
            enable_gqa=heads != key.shape[2],  # only when needed: not every fused kernel has it
        )


class KVCache:
    """The keys and values of every position seen so far, per attention layer: generation feeds
    only the new tokens and attends to these (``mega.plugins.models.gpt.generate``)."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(
        self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key``/``value [b, s_new, ng, d]``; returns all of the layer's ``[b, s, ng, d]``."""
        past = self._layers.get(id(layer))
        if past is not None:
            key, value = torch.cat((past[0], key), dim=1), torch.cat((past[1], value), dim=1)
        self._layers[id(layer)] = (key, value)
        return key, value


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, causal: bool = True) -> None:
        super().__init__()
        heads, groups = cfg.num_attention_heads, cfg.resolved_num_query_groups()
        self.head_dim = cfg.resolved_kv_channels()
        self.heads_per_group = heads // groups
        bias = cfg.add_bias_linear
        # Rows grouped like Megatron: for each group [np/ng query heads, 1 key head, 1 value head].
        qkv_rows = groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = Linear(cfg.hidden_size, qkv_rows, bias=bias or cfg.add_qkv_bias)
        # --qk-layernorm: per-head norms over d, shared by the heads (Megatron's names). Under
        # tensor parallelism each rank normalises its own heads: the weights are replicated and
        # their gradients partial sums over TP (plan.py)
        self.q_layernorm = _norm(cfg, self.head_dim) if cfg.qk_layernorm else None
        self.k_layernorm = _norm(cfg, self.head_dim) if cfg.qk_layernorm else None
        self.core_attention = CoreAttention(cfg.attention_dropout, cfg.attention_backend, causal)
        self.linear_proj = Linear(heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        per_group, d = self.heads_per_group, self.head_dim
        qkv = self.linear_qkv(hidden)
        # b and s are read from the projection, not the input: under sequence parallelism the
        # input holds s/tp positions and the column-parallel projection gathers all s of them.
        # The group count is read from the weight (-1), so a layer holding only some of the
        # groups (tensor parallel) runs unchanged.
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, per_group + 2, d)  # [b, s, ng, np/ng+2, d]
        query = qkv[:, :, :, :per_group].reshape(b, s, -1, d)  # [b, s, np, d], group-major heads
        key, value = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]  # [b, s, ng, d]
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        if kv_cache is not None:  # the mask then covers [new positions, all positions]
            key, value = kv_cache.extend(self, key, value)
        context = self.core_attention(query, key, value, attention_mask)  # [b, s, np*d]
        return self.linear_proj(context)


# the MLP's activations by GPTConfig.mlp_activation's names (SwiGLU's gate is applied apart)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact erf GeLU, Megatron's default
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's (--openai-gelu)
    "relu": F.relu,  # the original T5's
}


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ffn: int | None = None) -> None:
        super().__init__()
        ffn = ffn or cfg.resolved_ffn_hidden_size()
        activation = cfg.mlp_activation()
        self.activation_name = activation
        self.swiglu = activation == "swiglu"
        self.activation = None if self.swiglu else ACTIVATIONS[activation]
        fc1_rows = 2 * ffn if self.swiglu else ffn  # SwiGLU: [gate; up] stacked on the output dim
        self.linear_fc1 = Linear(cfg.hidden_size, fc1_rows, bias=cfg.add_bias_linear)
        self.linear_fc2 = Linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if fuses_gelu_mlp(self.activation_name, fc1.weight, fc2.weight):
            # FP8: FC2's input and FC1's output gradient cast straight from the GEMMs' outputs
            partial = fp8_gelu_mlp(
                fc1.gather_input(hidden), fc1.weight, fc1.bias, fc2.weight, fc2.bias is not None,
                (sites_of(fc1), sites_of(fc2)),
            )  # fmt: skip
            return fc2.reduce_output(partial)
        intermediate = fc1(hidden)  # [b, s, f] or [b, s, 2f]
        if self.swiglu:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up
        else:
            intermediate = self.activation(intermediate)
        return fc2(intermediate)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, cfg: GPTConfig, moe: bool = False, causal: bool = True) -> None:
        super().__init__()
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.self_attention = SelfAttention(cfg, causal)
        self.pre_mlp_layernorm = _norm(cfg, cfg.hidden_size)
        if moe:  # the experts replace the MLP (mega.plugins.models.gpt.moe)
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp = MoELayer(cfg, MLP(cfg, shared) if shared else None)
        else:
            self.mlp = MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        attention = self.self_attention(
            self.input_layernorm(hidden), rotary, attention_mask, kv_cache
        )
        hidden = hidden + self.hidden_dropout(attention)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


class TransformerBlock(nn.Module):
    """The decoder stack. It computes the RoPE tables itself so that any slice of it can run alone.

    ``sequence_shards`` is how many ranks the input's sequence is split over (sequence parallelism
    sets it to the tensor-parallel size): the RoPE tables must cover the full sequence, because
    attention sees all of it after the QKV projection gathers the shards.

    ``layer(cfg, moe, causal)`` builds each layer (BERT's post-norm layers replace the GPT's);
    ``final_norm``: end in a norm (pre-norm stacks do; post-norm ones are normalised already).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        causal: bool = True,
        layer: Callable[[GPTConfig, bool, bool], nn.Module] = TransformerLayer,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(cfg, moe, causal) for moe in cfg.moe_layers())
        self.final_layernorm = _norm(cfg, cfg.hidden_size) if final_norm else None
        self.rope = cfg.rotary()
        self.yarn = cfg if cfg.position_embedding_type == "yarn" else None
        self.head_dim = cfg.resolved_kv_channels()
        self.rotary_base = cfg.rotary_base
        self.llama3_factor = cfg.rope_scaling_factor if cfg.use_rope_scaling else None
        self.interpolation = cfg.rotary_seq_len_interpolation_factor
        self.sequence_shards = 1

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        rotary = None
        if self.rope:
            seq_length = hidden.shape[1] * self.sequence_shards  # explicit position_ids are full
            rotary = rotary_cos_sin(
                seq_length, self.head_dim, self.rotary_base, hidden.device, position_ids,
                llama3_factor=self.llama3_factor, interpolation=self.interpolation,
                yarn=self.yarn,
            )  # fmt: skip
        for layer in self.layers:
            if kv_cache is None:  # the call parallel plugins and compile see
                hidden = layer(hidden, rotary, attention_mask)
            else:
                hidden = layer(hidden, rotary, attention_mask, kv_cache)
        if self.final_layernorm is None:  # a pipeline stage before the last, or post-norm layers
            return hidden
        return self.final_layernorm(hidden)


class OutputHead(nn.Module):
    """Final hidden states x the ``[V, h]`` output weight -> logits, or the per-token loss.

    Parameter-free (the weight is passed in, tied or not), so tensor parallelism can swap it for
    a vocab-parallel head that never gathers the full-vocabulary logits.

    The padding rows of the vocabulary (ids >= ``vocab_size``) get logit -inf: they exist only so
    that the vocabulary splits evenly, and Megatron, which keeps them in the softmax, trains a
    model that changes with the tensor-parallel size (50257 pads to 50304 at TP=1, 50432 at TP=2).
    Masked, the loss and every real row's values are the same for any padding.
    """

    def __init__(self, vocab_size: int | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size  # the real vocabulary; None: no padding to mask

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden [b, s, h]`` -> logits ``[b, s, V]`` (plus ``bias [V]``: BERT's, T5's), or given
        ``labels [b, s]`` the float32 cross-entropy ``[b, s]``; given ``positions [n]`` too
        (flat indices into ``b x s``), only theirs: ``[1, n]``."""
        if positions is not None:
            hidden, labels = at_positions(hidden, labels, positions)
        logits = F.linear(hidden, weight, bias)  # [b, s, V]
        if self.vocab_size is not None and self.vocab_size < logits.shape[-1]:
            logits[..., self.vocab_size :] = float("-inf")  # linear's backward never reads it
        if labels is None:
            return logits
        # Cross-entropy in float32 whatever the model dtype: bf16 log-softmax over V loses digits.
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), reduction="none"
        )  # [b*s]
        return loss.view_as(labels)


def checked_max_positions(
    cfg: GPTConfig, ctx: BuildContext, model: str, lengths: dict[str, int] | None = None
) -> int:
    """What a model built on the GPT's config and layers (GPT, BERT, T5) refuses at build time:
    its config's problems, a context without the padded vocabulary, cuDNN attention off a GPU,
    a sequence longer than the learned position table. Returns that table's size. ``lengths``:
    flag -> positions the table must cover (default ``--seq-length``)."""
    problems = cfg.validate()
    if problems:
        raise ValueError(f"invalid {model} config: " + "; ".join(problems))
    if ctx.padded_vocab_size <= 0:
        raise ValueError("BuildContext.padded_vocab_size must be set before building the model")
    if cfg.attention_backend == "fused" and ctx.device != "cuda":
        raise ValueError(
            "--attention-backend fused is cuDNN's attention and needs a CUDA GPU; "
            "use flash, unfused or auto on the CPU"
        )
    max_positions = cfg.resolved_max_position_embeddings(ctx.seq_length)
    if cfg.position_embedding_type == "learned_absolute":
        for flag, length in (lengths or {"--seq-length": ctx.seq_length}).items():
            if length > max_positions:
                raise ValueError(
                    f"{flag} ({length}) exceeds --max-position-embeddings ({max_positions})"
                )
    return max_positions


RESIDUAL_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")  # each residual branch's last


@torch.no_grad()
def megatron_init_(
    model: nn.Module, seed: int, std: float, residual_std: Callable[[str], float]
) -> None:
    """Megatron's init of every parameter of ``model``, each drawn from (seed, its name) so the
    values do not depend on the layout: biases 0, norm weights 1, the residual branches' output
    weights N(0, ``residual_std(name)``) (Megatron: std / sqrt(2 x layers)), the rest N(0, std).
    The GPT, BERT and T5 models share it."""
    norms = {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm | nn.RMSNorm)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif name in norms:
            param.fill_(1.0)
        elif name.endswith(RESIDUAL_OUTPUTS):
            normal_(param, std=residual_std(name), seed=seed, name=name)
        else:
            normal_(param, std=std, seed=seed, name=name)


class GPTModel(nn.Module):
    """Decoder-only GPT. ``forward(tokens, labels=None)``: logits ``[b, s, V]`` or float32 loss ``[b, s]``."""

    def __init__(self, cfg: GPTConfig, ctx: BuildContext) -> None:
        super().__init__()
        max_positions = checked_max_positions(cfg, ctx, "GPT")
        self.config = cfg
        self.seed = ctx.seed
        self.share_embeddings_and_output_weights = not cfg.untie_embeddings_and_output_weights
        # Build on the meta device and materialise once: the default init would be thrown away.
        with on_meta():
            self.embedding = Embedding(cfg, ctx.padded_vocab_size, max_positions)
            self.decoder = TransformerBlock(cfg)
            self.output_layer = None
            if not self.share_embeddings_and_output_weights:
                self.output_layer = nn.Linear(cfg.hidden_size, ctx.padded_vocab_size, bias=False)
            vocab_size = getattr(ctx.tokenizer, "vocab_size", None)
            self.output_head = OutputHead(vocab_size)
        if ctx.device != "meta":  # a planning build (mega.core.plan): shapes, no init
            self.to_empty(device="cpu")
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init, drawn per parameter from (seed, name): layout-invariant."""
        cfg = self.config
        scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        megatron_init_(self, self.seed, cfg.init_method_std, lambda name: scaled_std)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, h]`` matrix that produces logits: the word embeddings when tied."""
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``tokens [b, s]``; optional ``position_ids [b, s]`` (--reset-position-ids) and
        ``attention_mask [b, 1, s, s]`` bool, True = masked (--reset-attention-mask).
        ``kv_cache`` (generation): ``tokens`` are the new positions after those in the cache,
        ``position_ids`` their positions, ``attention_mask [b, 1, s_new, s_all]``.

        As a pipeline stage (``plan.py``): ``hidden_states [b, s, h]`` is the previous stage's
        output and replaces the embedding; a stage without the output head returns its hidden
        states."""
        if hidden_states is None:
            hidden = self.embedding(tokens, position_ids)  # [b, s, h]
        else:
            hidden = hidden_states
        if kv_cache is None:
            hidden = self.decoder(hidden, position_ids, attention_mask)
        else:
            hidden = self.decoder(hidden, position_ids, attention_mask, kv_cache)
        if self.output_head is None:
            return hidden
        return self.output_head(hidden, self.output_weight(), labels)
