"""How a Megatron-LM GPT maps onto mega's: its ``args`` -> mega's model section, its tensor
names -> mega's, and the shape every tensor must have.

mega keeps Megatron's global layout (QKV rows grouped per query group, SwiGLU ``[gate; up]``),
so tensors are only renamed: the Transformer Engine spec fuses each pre-norm into the next
linear (``linear_qkv.layer_norm_weight``; torch_dist saves the local spec's norms under these
names too), and the vocabulary's padding rows are dropped.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.core.errors import MegaUsageError

# a Megatron flag that changes the function computed, and is not in mega's GPT:
# (args field, the value that is fine, what it means)
UNSUPPORTED = (
    ("num_experts", None, "MoE (--num-experts)"),
    ("multi_latent_attention", False, "--multi-latent-attention"),
    ("qk_layernorm", False, "--qk-layernorm"),
    ("qk_l2_norm", False, "--qk-l2-norm"),
    ("apply_layernorm_1p", False, "--apply-layernorm-1p (zero-centred gamma)"),
    ("layernorm_zero_centered_gamma", False, "zero-centred LayerNorm gamma"),
    ("apply_residual_connection_post_layernorm", False,
     "--apply-residual-connection-post-layernorm"),
    ("squared_relu", False, "--squared-relu"),
    ("quick_geglu", False, "--quick-geglu"),
    ("rotary_interleaved", False, "--rotary-interleaved"),
    ("use_rope_scaling", False, "--use-rope-scaling"),
    ("rotary_seq_len_interpolation_factor", None, "--rotary-seq-len-interpolation-factor"),
    ("window_size", None, "sliding-window attention (--window-size)"),
    ("softmax_scale", None, "--softmax-scale"),
    ("mtp_num_layers", None, "multi-token prediction (--mtp-num-layers)"),
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
    rope = get("use_rotary_position_embeddings") or get("position_embedding_type") == "rope"
    position = "rope" if rope else get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise MegaUsageError(f"{where}: --position-embedding-type {position} is not supported")
    if rope and float(get("rotary_percent", 1.0)) != 1.0:
        raise MegaUsageError(f"{where}: --rotary-percent {get('rotary_percent')} is not supported")
    normalization = get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise MegaUsageError(f"{where}: --normalization {normalization} is not supported")
    bias = bool(get("add_bias_linear", True))
    if get("add_qkv_bias") and not bias:
        raise MegaUsageError(f"{where}: --add-qkv-bias without linear biases is not supported")
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
        "openai_gelu": bool(get("openai_gelu")),
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
            if bias:
                shapes[f"{p}{name}.bias"] = shape[:1]
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
