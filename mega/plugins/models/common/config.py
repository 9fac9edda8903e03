"""The transformer config every model family builds on: Megatron-LM's flag names, no torch.

``GPTConfig`` holds the flags of mega's GPT-style transformer (sizes, positions, norms, MLP,
attention, mixture of experts). The gpt model uses it as it is; moe, bert and t5 subclass it
(their own defaults and flags). It lives here, not in the gpt plugin, so that no model plugin
imports another.

Derived sizes (FFN width, query groups, head dim) are resolved by small methods here, so the models,
the FLOPs formula and the parallel plans all read one definition.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import ClassVar

from mega.core.config.fields import option

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")  # yarn: rope, YaRN-scaled
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
DROP_POLICIES = ("probs", "position")
# the built-in attention kernels (mega.parallel.attention_kernels); a plugin may register more
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")


@dataclass(kw_only=True)
class GPTConfig:
    """A decoder-only transformer, pre-norm, with Megatron-core's parameter names."""

    # what a run may set differently from the checkpoint it loads with --use-checkpoint-args:
    # these leave the learned function as it is
    CHANGEABLE_ON_LOAD: ClassVar[tuple[str, ...]] = (
        "hidden_dropout", "attention_dropout", "attention_backend", "use_flash_attn",
        "init_method_std", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_grouped_gemm",
        "moe_token_dispatcher_type", "moe_expert_capacity_factor",
        "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
        "moe_router_load_balancing_type", "overlap_moe_expert_parallel_comm",
    )  # fmt: skip

    # the --position-embedding-type values this model builds (T5 swaps rope for relative)
    POSITION_EMBEDDINGS: ClassVar[tuple[str, ...]] = POSITION_EMBEDDING_TYPES

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
    use_rope_scaling: bool = option(
        False,
        "Llama 3.x's RoPE frequency scaling (Hugging Face's rope_type 'llama3'): wavelengths"
        " over 8192 positions divided by --rope-scaling-factor, under 2048 kept, blended"
        " between (Megatron's fixed low/high frequency factors 1 and 4, original context 8192).",
    )
    rope_scaling_factor: float = option(
        8.0, "--use-rope-scaling's factor (Llama 3.1: 8, Llama 3.2: 32)."
    )
    rotary_seq_len_interpolation_factor: float | None = option(
        None,
        "Linear RoPE scaling (Hugging Face's rope_type 'linear'): positions divided by this"
        " factor.",
    )
    # --position-embedding-type yarn (Megatron's YarnRotaryEmbedding; Hugging Face's 'yarn')
    yarn_rotary_scaling_factor: float = option(1.0, "YaRN: the context extension factor.")
    yarn_original_max_position_embeddings: int = option(
        4096, "YaRN: the context the model was pretrained at."
    )
    yarn_beta_fast: float = option(32.0, "YaRN: rotations where extrapolation ends.")
    yarn_beta_slow: float = option(1.0, "YaRN: rotations where interpolation begins.")
    yarn_mscale: float = option(1.0, "YaRN: cos/sin scale numerator's mscale.")
    yarn_mscale_all_dim: float = option(
        0.0, "YaRN: cos/sin scale denominator's mscale (0: no denominator)."
    )
    yarn_correction_range_round_to_int: bool = option(
        True, "YaRN: round the ramp's dimension range outward to integers."
    )
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
        "Attention kernels: flash (FlashAttention), fused (cuDNN), unfused (plain math), auto "
        "(PyTorch's choice: cuDNN on Hopper GPUs with torch 2.11), or a plugin's kernel. Context "
        "parallelism's blocks follow it.",
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
    add_qkv_bias: bool = option(
        False, "Give the QKV projection biases, even with --disable-bias-linear (Qwen2's)."
    )
    qk_layernorm: bool = option(
        False,
        "Normalise each query and key head over the head dim (--normalization; one weight of"
        " head-dim size for the queries, one for the keys) before RoPE (Qwen3's).",
    )

    # ---- mixture of experts (Megatron's --num-experts family; common/moe.py) ----
    num_experts: int | None = option(
        None, "Experts per MoE layer: the MLP of the layers --moe-layer-freq picks becomes them."
    )
    moe_ffn_hidden_size: int | None = option(
        None, "Each expert's MLP hidden size (default: --ffn-hidden-size)."
    )
    moe_router_topk: int = option(2, "Experts each token is routed to.")
    moe_router_score_function: str = option(
        "softmax", "Router score: softmax or sigmoid.", choices=SCORE_FUNCTIONS
    )
    moe_router_pre_softmax: bool = option(
        False, "Softmax over all experts before the top-k (default: over the top-k logits)."
    )
    moe_router_topk_scaling_factor: float | None = option(
        None, "Multiply the top-k routing weights by this factor."
    )
    moe_router_load_balancing_type: str = option(
        "aux_loss",
        "Load balancing: aux_loss (per micro-batch), seq_aux_loss (per sequence), sinkhorn, none.",
        choices=LOAD_BALANCING_TYPES,
    )
    moe_aux_loss_coeff: float = option(0.0, "Weight of the load-balancing loss.")
    moe_z_loss_coeff: float | None = option(None, "Weight of the router z-loss (ST-MoE).")
    moe_layer_freq: str = option(
        "1",
        "Which layers are MoE: N (every N-th, from layer 0) or a 0/1 list such as"
        " '[0]+[1]*3' (one entry per layer).",
    )
    moe_shared_expert_intermediate_size: int | None = option(
        None, "Hidden size of a shared expert every token also goes through (none by default)."
    )
    moe_expert_capacity_factor: float | None = option(
        None, "Expert capacity = factor x tokens x topk / experts; tokens over it are dropped."
    )
    moe_pad_expert_input_to_capacity: bool = option(
        False, "With a capacity factor: pad every expert's input to its capacity."
    )
    moe_token_drop_policy: str = option(
        "probs",
        "With a capacity factor, which tokens an expert keeps: highest probs or first positions.",
        choices=DROP_POLICIES,
    )
    moe_grouped_gemm: bool = option(
        False, "Run the local experts as one grouped GEMM on a GPU (torch._grouped_mm)."
    )
    moe_token_dispatcher_type: str = option(
        "allgather", "How tokens reach their experts' ranks (a registered dispatcher)."
    )
    overlap_moe_expert_parallel_comm: bool = option(
        False,
        "Run the expert-parallel trips beside the experts' GEMMs: the tokens in two chunks, each"
        " one's all-to-alls on a side stream while the other's experts compute (flex dispatcher;"
        " refused on GPUs for now: it raced and ran slower there, docs/moe.md).",
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

    def rotary(self) -> bool:
        """Whether positions are rotary (rope, or yarn's scaled rope)."""
        return self.position_embedding_type in ("rope", "yarn")

    def resolved_max_position_embeddings(self, seq_length: int) -> int:
        return self.max_position_embeddings or seq_length

    def mlp_activation(self) -> str:
        """The MLP's activation: ``swiglu`` (gated: fc1 holds ``[gate; up]``), ``gelu`` (exact
        erf, Megatron's default) or ``gelu_tanh`` (--openai-gelu). A model whose config adds
        activations (T5's ``relu``) overrides this."""
        if self.swiglu:
            return "swiglu"
        return "gelu_tanh" if self.openai_gelu else "gelu"

    def resolved_moe_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.resolved_ffn_hidden_size()

    def moe_layers(self) -> list[bool]:
        """Which layers have experts instead of an MLP (all False without --num-experts)."""
        if not self.num_experts:
            return [False] * self.num_layers
        return [bool(x) for x in layer_pattern(self.moe_layer_freq, self.num_layers)]

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
        if self.position_embedding_type not in self.POSITION_EMBEDDINGS:
            problems.append(
                f"--position-embedding-type ({self.position_embedding_type!r}) must be one of "
                f"{', '.join(self.POSITION_EMBEDDINGS)}"
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
        if self.rotary() and head_dim % 2:
            problems.append(f"rope needs an even head dim (--kv-channels), got {head_dim}")
        if self.openai_gelu and self.swiglu:
            problems.append("--openai-gelu and --swiglu: SwiGLU uses no GeLU; give one of them")
        return problems + self._rope_scaling_problems() + self._moe_problems()

    def _rope_scaling_problems(self) -> list[str]:
        problems: list[str] = []
        interpolation = self.rotary_seq_len_interpolation_factor
        scalings = [flag for flag, on in (
            ("--use-rope-scaling", self.use_rope_scaling),
            ("--rotary-seq-len-interpolation-factor", interpolation is not None),
        ) if on]  # fmt: skip
        if self.position_embedding_type == "yarn" and self.yarn_rotary_scaling_factor <= 0:
            problems.append(
                f"--yarn-rotary-scaling-factor ({self.yarn_rotary_scaling_factor}) must be positive"
            )
        if scalings and self.position_embedding_type != "rope":
            problems.append(f"{scalings[0]} needs --position-embedding-type rope")
        if len(scalings) == 2:
            problems.append(f"{' and '.join(scalings)}: give one RoPE scaling")
        if interpolation is not None and interpolation <= 0:
            problems.append(
                f"--rotary-seq-len-interpolation-factor ({interpolation}) must be positive"
            )
        if self.use_rope_scaling and self.rope_scaling_factor <= 0:
            problems.append(f"--rope-scaling-factor ({self.rope_scaling_factor}) must be positive")
        return problems

    def _moe_problems(self) -> list[str]:
        problems: list[str] = []
        if self.num_experts is None:
            return problems
        experts, topk = self.num_experts, self.moe_router_topk
        if experts < 1:
            return [f"--num-experts ({experts}) must be positive"]
        if not 1 <= topk <= experts:
            problems.append(
                f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})"
            )
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{_flag(name)} ({value}) must be positive")
        try:
            layer_pattern(self.moe_layer_freq, self.num_layers)
        except ValueError as exc:
            problems.append(str(exc))
        if self.add_bias_linear:
            problems.append(
                "--num-experts: experts have no biases in mega (as in grouped GEMMs); add"
                " --disable-bias-linear"
            )
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff or 0) < 0:
            problems.append("--moe-aux-loss-coeff and --moe-z-loss-coeff must not be negative")
        if (
            topk == 1
            and self.moe_router_score_function == "softmax"
            and not self.moe_router_pre_softmax
            and self.moe_router_load_balancing_type != "sinkhorn"
        ):  # a softmax over one logit is 1: the router would learn nothing from the loss
            problems.append(
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax"
            )
        if self.moe_router_load_balancing_type == "sinkhorn":
            if topk != 1:
                problems.append(
                    "--moe-router-load-balancing-type sinkhorn needs --moe-router-topk 1"
                )
            if self.moe_aux_loss_coeff:
                problems.append(
                    "--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff"
                )
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor <= 0:
            problems.append(f"--moe-expert-capacity-factor ({factor}) must be positive")
        if factor is not None and self.moe_router_load_balancing_type == "sinkhorn":
            problems.append(
                "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss or none load"
                " balancing, not sinkhorn"
            )
        if self.moe_pad_expert_input_to_capacity and factor is None:
            problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        return problems


def layer_pattern(freq: str | int, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq: ``N`` makes every N-th layer (0, N, 2N...) MoE; a list
    expression of 0s and 1s (``[1,0,1,0]``, ``([0]+[1]*3)*2``) gives each layer."""
    text = str(freq).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--moe-layer-freq ({text}) must be positive")
        return [int(i % n == 0) for i in range(num_layers)]
    try:
        pattern = _list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        raise ValueError(
            f"--moe-layer-freq ({text!r}) must be an integer or a list of 0/1 such as"
            f" '[0]+[1]*3' ({exc})"
        ) from None
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise ValueError(
            f"--moe-layer-freq ({text!r}) must give 0 or 1 for each of the {num_layers} layers"
            f" (it gives {len(pattern)} values)"
        )
    return pattern


def _list_expression(node: ast.AST) -> list[int]:
    """A list of ints from ``[..]``, ``+`` and ``* int`` only (nothing is evaluated)."""
    if isinstance(node, ast.List):
        values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        if len(values) != len(node.elts) or not all(type(v) is int for v in values):
            raise ValueError("list entries must be integers")
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.right, ast.Constant) and type(node.right.value) is int:
            return _list_expression(node.left) * node.right.value
        if isinstance(node.left, ast.Constant) and type(node.left.value) is int:
            return _list_expression(node.right) * node.left.value
    raise ValueError("only lists, + and * an integer are allowed")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
