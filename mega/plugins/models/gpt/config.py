"""GPT model config: Megatron-LM's flag names, importable without torch.

Derived sizes (FFN width, query groups, head dim) are resolved by small methods here, so the model,
the FLOPs formula and later the parallel plans all read one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mega.core.config.fields import option

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")


@dataclass(kw_only=True)
class GPTConfig:
    """A decoder-only transformer, pre-norm, with Megatron-core's parameter names."""

    # what a run may set differently from the checkpoint it loads with --use-checkpoint-args:
    # these leave the learned function as it is
    CHANGEABLE_ON_LOAD: ClassVar[tuple[str, ...]] = (
        "hidden_dropout", "attention_dropout", "attention_backend", "use_flash_attn",
        "init_method_std",
    )  # fmt: skip

    num_layers: int = option(4, "Number of transformer layers.")
    hidden_size: int = option(128, "Transformer hidden size.")
    ffn_hidden_size: int | None = option(
        None,
        "MLP hidden size. Default: 4 * hidden size; with --swiglu, int((4*hidden*2/3)/64)*64.",
    )
    num_attention_heads: int = option(4, "Number of attention (query) heads.")
    group_query_attention: bool = option(False, "Use grouped-query attention (GQA).")
    num_query_groups: int | None = option(
        None, "Key/value groups with --group-query-attention (default 1, as in Megatron)."
    )
    kv_channels: int | None = option(
        None, "Per-head projection size. Default: hidden size / number of attention heads."
    )
    max_position_embeddings: int | None = option(
        None, "Size of the learned position table. Default: the run's --seq-length."
    )
    position_embedding_type: str = option(
        "learned_absolute", "Position embedding type.", choices=POSITION_EMBEDDING_TYPES
    )
    rotary_base: int = option(10000, "Base of the rotary position embedding frequencies.")
    normalization: str = option("LayerNorm", "Normalization layer type.", choices=NORMALIZATIONS)
    norm_epsilon: float = option(1e-5, "Epsilon of the normalization layers.")
    swiglu: bool = option(False, "Use the gated SwiGLU MLP instead of GeLU.")
    openai_gelu: bool = option(
        False, "Use OpenAI's tanh approximation of GeLU (GPT-2's) instead of the exact one."
    )
    untie_embeddings_and_output_weights: bool = option(
        False, "Give the output layer its own weights instead of reusing the word embeddings."
    )
    hidden_dropout: float = option(0.1, "Dropout on embeddings and after each residual branch.")
    attention_dropout: float = option(0.1, "Dropout on the attention probabilities.")
    attention_backend: str = option(
        "auto",
        "Attention kernels: flash (FlashAttention), fused (cuDNN), unfused (plain math), or auto "
        "(PyTorch's choice: cuDNN on Hopper GPUs with torch 2.11).",
        choices=ATTENTION_BACKENDS,
    )
    use_flash_attn: bool = option(
        False, "Megatron's older switch for --attention-backend flash (FlashAttention)."
    )
    init_method_std: float = option(0.02, "Std of the normal distribution initialising weights.")
    add_bias_linear: bool = option(
        True,
        "Disable the biases of the linear layers.",
        flag="--disable-bias-linear",
        store=False,
    )

    def __post_init__(self) -> None:
        # --use-flash-attn becomes the backend it names, so the resolved config says what runs
        if self.use_flash_attn:
            if self.attention_backend not in ("auto", "flash"):
                raise ValueError(
                    "--use-flash-attn means --attention-backend flash, but --attention-backend"
                    f" {self.attention_backend} is given"
                )
            self.attention_backend, self.use_flash_attn = "flash", False

    # ---- derived sizes -------------------------------------------------------------------------

    def resolved_num_query_groups(self) -> int:
        """Key/value heads: --num-query-groups under --group-query-attention (Megatron's default
        there is 1, i.e. multi-query attention), else one per head."""
        if self.group_query_attention:
            return self.num_query_groups if self.num_query_groups is not None else 1
        return self.num_attention_heads

    def resolved_kv_channels(self) -> int:
        """Head dim: --kv-channels, else hidden size / heads (Megatron's default)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    def resolved_ffn_hidden_size(self) -> int:
        """MLP width; SwiGLU's default keeps ~the GeLU parameter count, rounded down to 64."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    def resolved_max_position_embeddings(self, seq_length: int) -> int:
        return self.max_position_embeddings or seq_length

    # ---- validation ----------------------------------------------------------------------------

    def validate(self) -> list[str]:
        """Every problem with this config, one short message each, naming the flags involved."""
        problems: list[str] = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "rotary_base"):
            value = getattr(self, name)
            if value <= 0:
                problems.append(f"{_flag(name)} ({value}) must be positive")
        for name in (
            "ffn_hidden_size",
            "num_query_groups",
            "kv_channels",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{_flag(name)} ({value}) must be positive")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                problems.append(f"{_flag(name)} ({value}) must be in [0, 1)")
        if self.norm_epsilon <= 0:
            problems.append(f"--norm-epsilon ({self.norm_epsilon}) must be positive")
        if self.init_method_std < 0:
            problems.append(f"--init-method-std ({self.init_method_std}) must not be negative")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            problems.append(
                f"--position-embedding-type ({self.position_embedding_type!r}) must be one of "
                f"{', '.join(POSITION_EMBEDDING_TYPES)}"
            )
        if self.normalization not in NORMALIZATIONS:
            problems.append(
                f"--normalization ({self.normalization!r}) must be one of {', '.join(NORMALIZATIONS)}"
            )
        if problems:  # the checks below divide by these sizes
            return problems

        heads = self.num_attention_heads
        if self.kv_channels is None and self.hidden_size % heads:
            problems.append(
                f"--hidden-size ({self.hidden_size}) must be divisible by "
                f"--num-attention-heads ({heads}) unless --kv-channels is set"
            )
        if self.group_query_attention and self.num_query_groups is not None:
            groups = self.num_query_groups
            if groups > heads:
                problems.append(
                    f"--num-query-groups ({groups}) must not exceed --num-attention-heads ({heads})"
                )
            elif heads % groups:
                problems.append(
                    f"--num-attention-heads ({heads}) must be divisible by "
                    f"--num-query-groups ({groups})"
                )
        if self.ffn_hidden_size is None and self.resolved_ffn_hidden_size() <= 0:
            problems.append(
                f"--hidden-size ({self.hidden_size}) is too small for the default SwiGLU "
                "--ffn-hidden-size (rounds down to 0); set --ffn-hidden-size"
            )
        head_dim = self.resolved_kv_channels()
        if self.position_embedding_type == "rope" and head_dim % 2:
            problems.append(f"rope needs an even head dim (--kv-channels), got {head_dim}")
        if self.openai_gelu and self.swiglu:
            problems.append("--openai-gelu and --swiglu: SwiGLU uses no GeLU; give one of them")
        return problems


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flops_per_token(cfg: GPTConfig, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward), Megatron/PaLM style.

    ``6 * N + 12 * L * (np * d) * s``, where

    * ``N`` counts the matmul weights one token passes through: per layer
      ``h*(np*d + 2*ng*d)`` (QKV) + ``np*d*h`` (proj) + ``h*f*g`` (fc1, ``g`` = 2 with SwiGLU)
      + ``f*h`` (fc2), times ``L`` layers, plus the output projection ``h*V`` once (tied or not).
      Biases, norms and the embedding lookups (word and position) are excluded: they are not
      matmuls. ``6 = 2`` (multiply-add) ``* 3`` (forward, input grad, weight grad).
    * ``12 * L * (np*d) * s`` is attention itself: ``Q @ K^T`` and ``P @ V`` are ``2 * 2 * np*d*s``
      FLOPs per token forward, times 3 for training. The causal mask is not discounted (as in
      Megatron's and PaLM's accounting).

    ``h`` hidden, ``np`` heads, ``ng`` query groups, ``d`` kv channels, ``f`` ffn hidden,
    ``L`` layers, ``s`` sequence length, ``V`` padded vocab.
    """
    h, layers = cfg.hidden_size, cfg.num_layers
    heads, groups = cfg.num_attention_heads, cfg.resolved_num_query_groups()
    d, ffn = cfg.resolved_kv_channels(), cfg.resolved_ffn_hidden_size()
    gate = 2 if cfg.swiglu else 1
    per_layer = h * (heads * d + 2 * groups * d) + heads * d * h + h * ffn * gate + ffn * h
    matmul_params = layers * per_layer + h * padded_vocab_size
    attention = 12 * layers * heads * d * seq_length
    return float(6 * matmul_params + attention)
