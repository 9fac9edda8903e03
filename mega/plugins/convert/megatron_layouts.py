"""How a Megatron-LM GPT maps onto mega's: its ``args`` -> mega's model section, its tensor
names -> mega's, and the shape every tensor must have.

mega keeps Megatron's global layout (QKV rows grouped per query group, SwiGLU ``[gate; up]``),
so tensors are only renamed: the Transformer Engine spec fuses each pre-norm into the next
linear (``linear_qkv.layer_norm_weight``; torch_dist saves the local spec's norms under these
names too), and the vocabulary's padding rows are dropped.
"""

from __future__ import annotations

import re
from argparse import Namespace
from typing import Any

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.errors import MegaUsageError

# a Megatron flag that changes the function computed, and is not in mega's GPT:
# (args field, the value that is fine, what it means)
UNSUPPORTED = (
    ("num_experts", None, "MoE (--num-experts)"),
    ("multi_latent_attention", False, "--multi-latent-attention"),
    ("qk_l2_norm", False, "--qk-l2-norm"),
    ("apply_layernorm_1p", False, "--apply-layernorm-1p (zero-centred gamma)"),
    ("layernorm_zero_centered_gamma", False, "zero-centred LayerNorm gamma"),
    ("apply_residual_connection_post_layernorm", False,
     "--apply-residual-connection-post-layernorm"),
    ("squared_relu", False, "--squared-relu"),
    ("quick_geglu", False, "--quick-geglu"),
    ("rotary_interleaved", False, "--rotary-interleaved"),
    ("window_size", None, "sliding-window attention (--window-size)"),
    ("softmax_scale", None, "--softmax-scale"),
    ("mtp_num_layers", None, "multi-token prediction (--mtp-num-layers)"),
)  # fmt: skip
# --position-embedding-type yarn: Megatron's args (TransformerConfig's fields), mega's names too
YARN_FIELDS = (
    "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
    "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int",
)  # fmt: skip
TOKENIZER_FLAGS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file", "vocab_extra_ids"),
    "BertWordPieceCase": ("vocab_file", "vocab_extra_ids"),
    "SentencePieceTokenizer": ("tokenizer_model", "vocab_extra_ids"),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}


def model_section(args: Namespace, where: str) -> dict[str, Any]:
    """mega's ``model`` config section from Megatron's ``args``, or a one-line error naming
    the first flag mega's GPT cannot express."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    for name, fine, what in UNSUPPORTED:
        if get(name, fine) not in (fine, 0, False, None):
            raise MegaUsageError(f"{where}: {what} is not supported ({name}={get(name)!r})")
    if get("swiglu") and get("openai_gelu"):
        raise MegaUsageError(f"{where}: --swiglu with --openai-gelu is not supported")
    yarn = get("position_embedding_type") == "yarn"
    rope = get("use_rotary_position_embeddings") or get("position_embedding_type") == "rope"
    position = "yarn" if yarn else "rope" if rope else get("position_embedding_type")
    position = position or "learned_absolute"
    rope = rope or yarn
    if position not in ("learned_absolute", "rope", "yarn"):
        raise MegaUsageError(f"{where}: --position-embedding-type {position} is not supported")
    scalings = [flag for flag, on in (
        ("--use-rope-scaling", bool(get("use_rope_scaling"))),
        ("--rotary-seq-len-interpolation-factor",
         get("rotary_seq_len_interpolation_factor") not in (None, 1, 1.0)),
    ) if on]  # fmt: skip
    if scalings and position != "rope":
        raise MegaUsageError(f"{where}: {scalings[0]} with --position-embedding-type {position}"
                             " is not supported (mega scales rope positions only)")  # fmt: skip
    if len(scalings) == 2:
        raise MegaUsageError(f"{where}: {' and '.join(scalings)} together are not supported")
    if rope and float(get("rotary_percent", 1.0)) != 1.0:
        raise MegaUsageError(f"{where}: --rotary-percent {get('rotary_percent')} is not supported")
    normalization = get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise MegaUsageError(f"{where}: --normalization {normalization} is not supported")
    bias = bool(get("add_bias_linear", True))
    h, heads = get("hidden_size"), get("num_attention_heads")
    model: dict[str, Any] = {
        "name": "gpt",
        "num_layers": get("num_layers"),
        "hidden_size": h,
        "num_attention_heads": heads,
        "ffn_hidden_size": get("ffn_hidden_size"),
        "position_embedding_type": position,
        "normalization": normalization,
        "norm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
        "swiglu": bool(get("swiglu")),
        # --onnx-safe only swaps erf for its ONNX-exportable twin: the same function
        "openai_gelu": tanh_gelu(args),
        "untie_embeddings_and_output_weights": bool(get("untie_embeddings_and_output_weights")),
        "add_bias_linear": bias,
        # --apply-query-key-layer-scaling divides scores by the layer number before the softmax
        # and multiplies them back inside it: fp16 overflow insurance, the same function
    }
    if None in (model["num_layers"], h, heads):
        raise MegaUsageError(f"{where}: args lack num_layers, hidden_size or num_attention_heads")
    if get("max_position_embeddings"):
        model["max_position_embeddings"] = get("max_position_embeddings")
    if rope:
        base = get("rotary_base", 10000)
        if float(base) != int(base):
            raise MegaUsageError(f"{where}: --rotary-base {base} is not a whole number")
        model["rotary_base"] = int(base)
    if get("add_qkv_bias") and not bias:  # with linear biases, QKV has its bias anyway
        model["add_qkv_bias"] = True
    if get("qk_layernorm"):  # mcore's q_layernorm/k_layernorm: per head, --normalization's
        model["qk_layernorm"] = True
    if get("use_rope_scaling"):  # Llama 3.x's frequency scaling, Megatron's fixed factors
        model["use_rope_scaling"] = True
        model["rope_scaling_factor"] = float(get("rope_scaling_factor", 8.0))
    if "--rotary-seq-len-interpolation-factor" in scalings:  # linear: positions / factor
        model["rotary_seq_len_interpolation_factor"] = float(
            get("rotary_seq_len_interpolation_factor")
        )
    if yarn:  # mcore's YarnRotaryEmbedding reads these args (TransformerConfig's names)
        model.update({name: get(name) for name in YARN_FIELDS if get(name) is not None})
    groups = get("num_query_groups") if get("group_query_attention") else None
    if groups and groups != heads:
        model["group_query_attention"], model["num_query_groups"] = True, groups
    if get("kv_channels") and get("kv_channels") != h // heads:
        model["kv_channels"] = get("kv_channels")
    for name in ("hidden_dropout", "attention_dropout", "init_method_std"):
        if get(name) is not None:
            model[name] = get(name)
    if model["ffn_hidden_size"] is None:
        model.pop("ffn_hidden_size")  # Megatron's default, which is mega's too
    return model


def tanh_gelu(args: Namespace) -> bool:
    """Whether the GeLU Megatron-LM ran is its tanh approximation (mega's ``openai_gelu``):
    its bias+GeLU fusion (``--bias-gelu-fusion``, on by default, off without biases) computes
    the tanh form in both model generations; legacy models also honour ``--openai-gelu``, which
    megatron-core's GPT never reads (it runs the exact erf GeLU)."""
    if getattr(args, "swiglu", False):
        return False
    if getattr(args, "bias_gelu_fusion", False) and getattr(args, "add_bias_linear", True):
        return True
    legacy = getattr(args, "use_legacy_models", not getattr(args, "use_mcore_models", False))
    return bool(getattr(args, "openai_gelu", False)) and bool(legacy)


def tokenizer_flags(args: Namespace) -> dict[str, Any]:
    """The data tokenizer's flags when mega has Megatron's tokenizer of that name, else none."""
    kind = getattr(args, "tokenizer_type", None)
    if kind not in TOKENIZER_FLAGS:
        return {}
    flags = {name: getattr(args, name, None) for name in TOKENIZER_FLAGS[kind]}
    return {"tokenizer_type": kind, **{k: v for k, v in flags.items() if v}}


def true_vocab_size(args: Namespace, given: int | None, padded: int, where: str) -> int:
    """The tokenizer's vocabulary (the embedding rows without Megatron's padding):
    ``--true-vocab-size``, else args' ``--vocab-size``, else a one-line error."""
    vocab = given
    if vocab is None and getattr(args, "vocab_size", None):
        # NullTokenizer's --vocab-size N excludes the EOD id N that it appends
        vocab = args.vocab_size + (getattr(args, "tokenizer_type", None) == "NullTokenizer")
    if vocab is None:
        raise MegaUsageError(
            f"{where}: args hold no --vocab-size, so the embedding's padding ({padded} rows,"
            " padded by Megatron) cannot be told from the vocabulary: pass --true-vocab-size N"
        )
    if not 0 < vocab <= padded:
        raise MegaUsageError(f"{where}: true vocab size {vocab} is not within the {padded} rows")
    return vocab


# Transformer Engine's fused names (and torch_dist's names for the local spec's norms) -> mega's
NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def expected_shapes(model: dict[str, Any], vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of mega's GPT for this config, with its shape, in mega's order."""
    from mega.plugins.models.gpt import GPTConfig

    cfg = GPTConfig(**{k: v for k, v in model.items() if k != "name"})
    h, heads, groups = cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_num_query_groups()
    d, ffn = cfg.resolved_kv_channels(), cfg.resolved_ffn_hidden_size()
    norm = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    bias = cfg.add_bias_linear
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (vocab, h)}
    if cfg.position_embedding_type == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (cfg.max_position_embeddings or 0, h)
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        linears = {
            "self_attention.linear_qkv": ((heads + 2 * groups) * d, h),
            "self_attention.linear_proj": (h, heads * d),
            "mlp.linear_fc1": (ffn * (2 if cfg.swiglu else 1), h),
            "mlp.linear_fc2": (h, ffn),
        }
        for kind in norm:
            shapes[f"{p}input_layernorm.{kind}"] = (h,)
        for name, shape in linears.items():
            if name == "mlp.linear_fc1":
                for kind in norm:
                    shapes[f"{p}pre_mlp_layernorm.{kind}"] = (h,)
            shapes[f"{p}{name}.weight"] = shape
            if bias or (name == "self_attention.linear_qkv" and cfg.add_qkv_bias):
                shapes[f"{p}{name}.bias"] = shape[:1]
            if name == "self_attention.linear_qkv" and cfg.qk_layernorm:
                for which in ("q", "k"):
                    for kind in norm:
                        shapes[f"{p}self_attention.{which}_layernorm.{kind}"] = (d,)
    for kind in norm:
        shapes[f"decoder.final_layernorm.{kind}"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        shapes["output_layer.weight"] = (vocab, h)
    return shapes


def _mega_name(name: str) -> str:
    for megatron, mega in NORM_NAMES.items():
        if name.endswith(megatron):
            return name[: -len(megatron)] + mega
    return name


def _rows(t: LazyTensor, rows: int) -> LazyTensor:
    return LazyTensor((rows, *t.shape[1:]), t.dtype, lambda: t.load()[:rows].clone())


def to_mega(
    tensors: SourceTensors, model: dict[str, Any], vocab: int, where: str
) -> dict[str, LazyTensor]:
    """Megatron's tensors -> mega's, checked against the config: a missing, unexpected or
    misshapen tensor is a one-line error naming it."""
    shapes = expected_shapes(model, vocab)
    renamed: dict[str, LazyTensor] = {}
    for name in tensors:
        if name == "output_layer.weight" and "output_layer.weight" not in shapes:
            tensors.ignore(name, "tied: the last pipeline stage's copy of the word embeddings")
            continue
        mega = _mega_name(name)
        if mega not in shapes:
            raise MegaUsageError(f"{where}: {name} has no place in mega's GPT for these args")
        t = tensors[name]
        renamed[mega] = _rows(t, vocab) if mega in VOCAB_ROWS else t
    out = {}
    for name, shape in shapes.items():
        if name not in renamed:
            raise MegaUsageError(f"{where}: no tensor {name} (args say it exists)")
        if renamed[name].shape != shape:
            found = renamed[name].shape
            raise MegaUsageError(f"{where}: {name} has shape {list(found)}, args say {list(shape)}")
        out[name] = renamed[name]
    return out


# ----------------------------------------------------------------------------- mega -> Megatron

# mega's GPT fields that Megatron-LM's args say as they are (the same flag, the same meaning);
# what is derived (FFN width, query groups, head dim) is written resolved
WRITTEN_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "num_query_groups", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "swiglu",
    "openai_gelu",
    "untie_embeddings_and_output_weights", "add_bias_linear", "hidden_dropout",
    "attention_dropout", "init_method_std", "add_qkv_bias", "qk_layernorm", "use_rope_scaling",
    "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
)  # fmt: skip
# Megatron-LM's padding of the vocabulary (its --make-vocab-size-divisible-by default, at TP=1)
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def _refusal(cfg: Any, where: str) -> str | None:
    """Why ``cfg`` cannot be written as Megatron-LM args (a one-line reason naming the flag), or
    None: a field outside ``WRITTEN_FIELDS`` must keep its default, unless it leaves the
    function as it is (``CHANGEABLE_ON_LOAD``) or only MoE reads it and there are no experts."""
    import dataclasses

    if cfg.num_experts:
        return f"{where}: --num-experts {cfg.num_experts}: MoE GPTs are not written to Megatron-LM"
    if cfg.openai_gelu and not cfg.swiglu and not cfg.add_bias_linear:
        # megatron-core's GPT never reads --openai-gelu: its one tanh GeLU is the bias+GeLU
        # fusion (``tanh_gelu``), and Megatron-LM turns that off without biases
        return (
            f"{where}: --openai-gelu with --disable-bias-linear: Megatron-LM's mcore GPT runs"
            " GeLU's tanh form only in its bias+GeLU fusion, which needs the biases"
        )
    if cfg.position_embedding_type not in ("learned_absolute", "rope"):
        # position_embedding_type is written as it is, but only learned and rope positions
        # are mapped (the yarn fields would be dropped even at their defaults)
        return (
            f"{where}: --position-embedding-type {cfg.position_embedding_type}: only"
            " learned_absolute and rope positions are written to Megatron-LM"
        )
    for f in dataclasses.fields(cfg):
        if f.name in WRITTEN_FIELDS or f.name in cfg.CHANGEABLE_ON_LOAD:
            continue
        if f.name.startswith("moe_"):  # read only by expert layers, and there are none
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(cfg, f.name)
        if value != default:
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            return (
                f"{where}: {flag} ({f.name}={value!r}) has no counterpart in the Megatron-LM args"
                " this converter writes; refused rather than written as another model"
            )
    return None


def megatron_args(
    model: dict[str, Any],
    vocab: int,
    padded_vocab: int,
    seq_length: int | None,
    tokenizer: dict[str, Any],
    dtype: Any,
    where: str,
) -> Namespace:
    """The ``args`` Megatron-LM saves with a checkpoint (``--use-checkpoint-args`` builds the
    model from them, and ``model_section`` reads them back) for mega's GPT ``model`` section;
    a one-line error naming the first field Megatron's GPT cannot be told this way."""
    import torch

    from mega.plugins.models.gpt import GPTConfig

    if model.get("name") != "gpt":
        raise MegaUsageError(
            f"{where}: a {model.get('name')!r} model; only GPT models are written to Megatron-LM"
        )
    try:
        cfg = GPTConfig(**{k: v for k, v in model.items() if k != "name"})
    except TypeError as exc:  # a field this mega's GPT does not have
        raise MegaUsageError(f"{where}: the model config is not this mega's GPT ({exc})") from None
    refused = _refusal(cfg, where)
    if refused:
        raise MegaUsageError(refused)
    rope = cfg.position_embedding_type == "rope"
    positions = cfg.resolved_max_position_embeddings(seq_length or 0) or None
    kind = tokenizer.get("tokenizer_type")
    flags = dict(tokenizer_flags(Namespace(**tokenizer))) if kind in TOKENIZER_FLAGS else {}
    flags.pop("tokenizer_type", None)
    # Megatron's NullTokenizer appends EOD to its --vocab-size: the vocabulary is one more
    vocab_flag = vocab - 1 if kind == "NullTokenizer" else vocab
    flags.pop("vocab_size", None)
    groups = cfg.resolved_num_query_groups()
    return Namespace(
        # the architecture (what Megatron-LM's load_args_from_checkpoint takes from here)
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.resolved_ffn_hidden_size(),
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=groups != cfg.num_attention_heads,
        num_query_groups=groups,
        kv_channels=cfg.resolved_kv_channels(),
        max_position_embeddings=positions,
        position_embedding_type=cfg.position_embedding_type,
        add_position_embedding=not rope,
        use_rotary_position_embeddings=rope,
        rotary_base=cfg.rotary_base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        normalization=cfg.normalization,
        norm_epsilon=cfg.norm_epsilon,
        apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False,
        apply_query_key_layer_scaling=False,
        qk_layernorm=cfg.qk_layernorm,
        use_rope_scaling=cfg.use_rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        rotary_seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
        swiglu=cfg.swiglu,
        # the tanh GeLU is the bias+GeLU fusion's (see tanh_gelu); --use-checkpoint-args does
        # not take this from here: an exact-GeLU model needs --no-bias-gelu-fusion there
        bias_gelu_fusion=bool(cfg.openai_gelu and not cfg.swiglu),
        openai_gelu=False,
        use_legacy_models=False,
        squared_relu=False,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        add_bias_linear=cfg.add_bias_linear,
        # with linear biases, Megatron-LM's validate_args turns QKV's on too
        add_qkv_bias=cfg.add_bias_linear or cfg.add_qkv_bias,
        num_experts=None,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        # the vocabulary: padded as Megatron pads it at TP=1 (the padding rows are zeros)
        vocab_size=vocab_flag,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=MAKE_VOCAB_SIZE_DIVISIBLE_BY,
        tokenizer_type=kind if kind in TOKENIZER_FLAGS else None,
        **{"vocab_file": None, "merge_file": None, "tokenizer_model": None, **flags},
        seq_length=seq_length,
        encoder_seq_length=seq_length,
        # the layout it was written at: torch_dist tensors are global, any TP/PP loads them
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        params_dtype=dtype,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        ckpt_format="torch_dist",
        use_mcore_models=True,
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )


def megatron_key(name: str, num_layers: int) -> tuple[str, int | None]:
    """mega's tensor name -> (its torch_dist key, the layer it is in the stacked key, or None):
    ``decoder.layers.3.input_layernorm.weight`` -> (``decoder.layers.self_attention.linear_qkv
    .layer_norm_weight``, 3)."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name, None
    rest = m.group(2)
    for megatron, mega in NORM_NAMES.items():
        if rest == mega:
            rest = megatron
            break
    layer = int(m.group(1))
    if not 0 <= layer < num_layers:
        raise MegaUsageError(f"{name}: layer {layer} of a {num_layers}-layer model")
    return f"decoder.layers.{rest}", layer
