"""How Hugging Face's GPT-2 and Llama models lay out the weights of mega's GPT, both ways
(Mixtral, a Llama with experts: ``hf_mixtral``).

mega's (Megatron's) layouts differ from both: the QKV projection is one matrix whose rows are
grouped per key/value head ``[np/ng query heads, key, value]``; SwiGLU's gate and up
projections are one ``linear_fc1`` of ``[gate; up]`` rows. GPT-2's ``Conv1D`` stores every
weight transposed (``[in, out]``) and its ``c_attn`` as ``[q | k | v]`` columns. The vocabulary
is never padded here: mega stores it without padding rows, as Hugging Face does.

Every reader takes its tensors from a ``SourceTensors`` and sets aside by name, with the reason,
what it does not use (non-persistent buffers older transformers saved, tied copies); the driver
refuses a conversion that leaves any other tensor out. A config field that changes the function
the model computes is in its family's table of supported values (``refuse_fields``), or read.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.errors import MegaUsageError

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
MIXTRAL = "MixtralForCausalLM"  # its layout: hf_mixtral
# Llama's relatives (hf_llama_like): Mistral reads as a Llama (it writes back as one: the same
# function and tensor names), Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms
MISTRAL, QWEN2, QWEN3 = "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
PHI3 = "Phi3ForCausalLM"  # Llama's function, fused projections: read, written as a Llama


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
) -> torch.Tensor:
    """Separate Q ``[np*d, ...]``, K and V ``[ng*d, ...]`` -> mega's grouped QKV rows."""
    d = k.shape[0] // groups
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, heads // groups, d, *rest),
        k.reshape(groups, 1, d, *rest),
        v.reshape(groups, 1, d, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    """mega's grouped QKV rows -> [Q, K, V] (inverse of :func:`merge_qkv`)."""
    per = heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per + 2, head_dim, *rest)
    q = grouped[:, :per].reshape(heads * head_dim, *rest)
    k = grouped[:, per].reshape(groups * head_dim, *rest)
    v = grouped[:, per + 1].reshape(groups * head_dim, *rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def _lazy(shape: tuple[int, ...], dtype: torch.dtype, make: Any) -> LazyTensor:
    return LazyTensor(tuple(shape), dtype, make)


def _transposed(t: LazyTensor) -> LazyTensor:
    return _lazy(t.shape[::-1], t.dtype, lambda: t.load().t().contiguous())


def _need(tensors: SourceTensors, name: str, where: str) -> LazyTensor:
    if name not in tensors:
        raise MegaUsageError(f"{where}: no tensor {name}")
    return tensors[name]


def refuse_fields(cfg: dict[str, Any], table: Any, where: str) -> None:
    """``table``: ``(config field, its default, the values mega computes the same function
    for)``; a value outside them is a one-line error naming the field."""
    for name, default, supported in table:
        value = cfg.get(name)
        value = default if value is None else value
        if value not in supported:
            only = " or ".join(repr(v) for v in supported)
            raise MegaUsageError(f"{where}: {name} {value!r} is not supported (only {only})")


def tied_output(
    cfg: dict[str, Any], hf: SourceTensors, output: str, embedding: str, default: bool
) -> bool:
    """Whether the HF model ties its output layer ``output`` to ``embedding``
    (``tie_word_embeddings``); a tied copy of it in the files is set aside, as transformers
    does not read it either."""
    value = cfg.get("tie_word_embeddings")
    tied = default if value is None else bool(value)
    if tied:
        hf.ignore(output, f"tie_word_embeddings is true: transformers uses {embedding}")
    return tied


# ----------------------------------------------------------------------------- GPT-2

GPT2_GELUS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # -> --openai-gelu
# GPT2Config fields that change the function computed, and what mega's GPT computes. Not here:
# reorder_and_upcast_attn (float32 scores for fp16 training: the same function), dropouts,
# summary_* (GPT2DoubleHeadsModel's head); n_inner, layer_norm_epsilon, n_positions and
# tie_word_embeddings are read.
GPT2_FIELDS = (
    ("activation_function", "gelu_new", tuple(GPT2_GELUS)),
    ("scale_attn_weights", True, (True,)),  # False: scores not divided by sqrt(head dim)
    ("scale_attn_by_inverse_layer_idx", False, (False,)),
    ("add_cross_attention", False, (False,)),
    ("pruned_heads", {}, ({},)),
)
GPT2_BUFFERS = ("attn.bias", "attn.masked_bias")  # the causal mask, saved by old transformers


def gpt2_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``GPT2LMHeadModel``, tied or untied."""
    refuse_fields(cfg, GPT2_FIELDS, where)
    act = cfg.get("activation_function") or "gelu_new"
    h, layers, heads = cfg["n_embd"], cfg["n_layer"], cfg["n_head"]
    p = "transformer." if "transformer.wte.weight" in hf else ""
    tied = tied_output(cfg, hf, "lm_head.weight", p + "wte.weight", default=True)
    model = {
        "name": "gpt",
        "num_layers": layers,
        "hidden_size": h,
        "num_attention_heads": heads,
        "ffn_hidden_size": cfg.get("n_inner") or 4 * h,
        "max_position_embeddings": cfg["n_positions"],
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "norm_epsilon": cfg.get("layer_norm_epsilon", 1e-5),
        "swiglu": False,
        "openai_gelu": GPT2_GELUS[act],
        "untie_embeddings_and_output_weights": not tied,
        "hidden_dropout": cfg.get("resid_pdrop", 0.1),
        "attention_dropout": cfg.get("attn_pdrop", 0.1),
        "add_bias_linear": True,
    }

    def get(name: str) -> LazyTensor:
        return _need(hf, p + name, where)

    out = {
        "embedding.word_embeddings.weight": get("wte.weight"),
        "embedding.position_embeddings.weight": get("wpe.weight"),
    }
    for i in range(layers):
        src, dst = f"h.{i}.", f"decoder.layers.{i}."
        hf.ignore([f"{p}{src}{b}" for b in GPT2_BUFFERS], "the causal mask: a buffer, not a weight")
        for hf_norm, mega_norm in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            for kind in ("weight", "bias"):
                out[f"{dst}{mega_norm}.{kind}"] = get(f"{src}{hf_norm}.{kind}")
        c_attn_w, c_attn_b = get(f"{src}attn.c_attn.weight"), get(f"{src}attn.c_attn.bias")

        def qkv_w(t: LazyTensor = c_attn_w) -> torch.Tensor:
            q, k, v = t.load().t().chunk(3, dim=0)
            return merge_qkv(q, k, v, heads, heads)

        def qkv_b(t: LazyTensor = c_attn_b) -> torch.Tensor:
            q, k, v = t.load().chunk(3, dim=0)
            return merge_qkv(q, k, v, heads, heads)

        out[f"{dst}self_attention.linear_qkv.weight"] = _lazy((3 * h, h), c_attn_w.dtype, qkv_w)
        out[f"{dst}self_attention.linear_qkv.bias"] = _lazy((3 * h,), c_attn_b.dtype, qkv_b)
        for hf_name, mega_name in (
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        ):
            out[f"{dst}{mega_name}.weight"] = _transposed(get(f"{src}{hf_name}.weight"))
            out[f"{dst}{mega_name}.bias"] = get(f"{src}{hf_name}.bias")
    out["decoder.final_layernorm.weight"] = get("ln_f.weight")
    out["decoder.final_layernorm.bias"] = get("ln_f.bias")
    if not tied:
        out["output_layer.weight"] = _need(hf, "lm_head.weight", where)
    return model, out


def mega_to_gpt2(
    model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int
) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``GPT2LMHeadModel`` from a mega GPT, tied or untied."""
    h, layers, heads = model["hidden_size"], model["num_layers"], model["num_attention_heads"]
    untied = bool(model.get("untie_embeddings_and_output_weights"))
    positions = mega["embedding.position_embeddings.weight"].shape[0]
    config = {
        "architectures": [GPT2],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": h,
        "n_layer": layers,
        "n_head": heads,
        "n_inner": model.get("ffn_hidden_size") or 4 * h,
        "n_positions": positions,
        "n_ctx": positions,
        "activation_function": "gelu_new" if model.get("openai_gelu") else "gelu",
        "layer_norm_epsilon": model.get("norm_epsilon", 1e-5),
        "resid_pdrop": model.get("hidden_dropout", 0.1),
        "embd_pdrop": model.get("hidden_dropout", 0.1),
        "attn_pdrop": model.get("attention_dropout", 0.1),
        "initializer_range": model.get("init_method_std", 0.02),
        "tie_word_embeddings": not untied,
    }
    d = h // heads
    out = {
        "transformer.wte.weight": mega["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": mega["embedding.position_embeddings.weight"],
    }
    for i in range(layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for hf_norm, mega_norm in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            for kind in ("weight", "bias"):
                out[f"{dst}{hf_norm}.{kind}"] = mega[f"{src}{mega_norm}.{kind}"]
        qkv_w = mega[f"{src}self_attention.linear_qkv.weight"]
        qkv_b = mega[f"{src}self_attention.linear_qkv.bias"]

        def c_attn_w(t: LazyTensor = qkv_w) -> torch.Tensor:
            return torch.cat(split_qkv(t.load(), heads, heads, d), dim=0).t().contiguous()

        def c_attn_b(t: LazyTensor = qkv_b) -> torch.Tensor:
            return torch.cat(split_qkv(t.load(), heads, heads, d), dim=0)

        out[f"{dst}attn.c_attn.weight"] = _lazy((h, 3 * h), qkv_w.dtype, c_attn_w)
        out[f"{dst}attn.c_attn.bias"] = _lazy((3 * h,), qkv_b.dtype, c_attn_b)
        for hf_name, mega_name in (
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        ):
            out[f"{dst}{hf_name}.weight"] = _transposed(mega[f"{src}{mega_name}.weight"])
            out[f"{dst}{hf_name}.bias"] = mega[f"{src}{mega_name}.bias"]
    out["transformer.ln_f.weight"] = mega["decoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = mega["decoder.final_layernorm.bias"]
    if untied:
        out["lm_head.weight"] = mega["output_layer.weight"]
    return config, out


# ----------------------------------------------------------------------------- Llama
# Mixtral (hf_mixtral) is a Llama whose MLPs are experts: it reuses the attention halves below.


def _llama_shape(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    return h, heads, groups, head_dim


# rope_scaling's llama3 constants that mega's --use-rope-scaling fixes (as Megatron does)
LLAMA3_FIXED = (
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)


def rope_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """mega's RoPE fields from ``rope_theta`` and ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (5): default, ``linear`` and ``llama3``; any other type is refused."""
    parameters = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or parameters
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    theta = cfg.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    if float(theta) != int(theta):
        raise MegaUsageError(f"{where}: rope_theta {theta} is not a whole number")
    fields: dict[str, Any] = {"rotary_base": int(theta)}
    if kind == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(scaling["factor"])
    elif kind == "llama3":
        for name, fixed in LLAMA3_FIXED:
            if float(scaling.get(name, fixed)) != fixed:
                raise MegaUsageError(
                    f"{where}: rope_scaling {name} {scaling[name]} is not supported (mega's"
                    f" --use-rope-scaling fixes it at {fixed}, as Megatron)"
                )
        fields.update(use_rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
    elif kind == "yarn":
        fields.update(yarn_fields(cfg, scaling, where))
    elif kind != "default":
        raise MegaUsageError(
            f"{where}: rope_scaling type {kind!r} is not supported (only linear, llama3, yarn)"
        )
    return fields


# rope_scaling yarn's optional keys -> mega's (Megatron's) fields, with transformers' defaults
YARN_KEYS = (
    ("beta_fast", "yarn_beta_fast", 32.0),
    ("beta_slow", "yarn_beta_slow", 1.0),
    ("truncate", "yarn_correction_range_round_to_int", True),
)


def yarn_fields(cfg: dict[str, Any], scaling: dict[str, Any], where: str) -> dict[str, Any]:
    """--position-embedding-type yarn's fields from ``rope_scaling`` ``yarn``. transformers
    scales cos/sin by mscale(mscale) / mscale(mscale_all_dim) when both are given, else by
    mscale(1): Megatron's formula with mscale_all_dim 0. An explicit attention_factor is
    refused."""
    if scaling.get("attention_factor") is not None:
        raise MegaUsageError(
            f"{where}: rope_scaling attention_factor {scaling['attention_factor']} is not"
            " supported (mega derives it from factor, mscale and mscale_all_dim)"
        )
    fields: dict[str, Any] = {
        "position_embedding_type": "yarn",
        "yarn_rotary_scaling_factor": float(scaling["factor"]),
        "yarn_original_max_position_embeddings": int(
            scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        ),
    }
    for key, field, default in YARN_KEYS:
        value = scaling.get(key)
        fields[field] = type(default)(default if value is None else value)
    both = scaling.get("mscale") and scaling.get("mscale_all_dim")
    fields["yarn_mscale"] = float(scaling["mscale"]) if both else 1.0
    fields["yarn_mscale_all_dim"] = float(scaling["mscale_all_dim"]) if both else 0.0
    return fields


def rope_scaling_config(model: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_scaling`` of ``config.json`` for a mega model (inverse of :func:`rope_fields`)."""
    if model.get("use_rope_scaling"):
        return {
            "rope_type": "llama3",
            "factor": float(model.get("rope_scaling_factor", 8.0)),
            **dict(LLAMA3_FIXED),
        }
    if model.get("position_embedding_type") == "yarn":
        config = {
            "rope_type": "yarn",
            "factor": float(model.get("yarn_rotary_scaling_factor", 1.0)),
            "original_max_position_embeddings": model.get(
                "yarn_original_max_position_embeddings", 4096
            ),
        }
        for key, field, default in YARN_KEYS:  # written where not transformers' default
            if model.get(field, default) != default:
                config[key] = model[field]
        if model.get("yarn_mscale_all_dim"):
            config["mscale"] = model.get("yarn_mscale", 1.0)
            config["mscale_all_dim"] = model["yarn_mscale_all_dim"]
        elif model.get("yarn_mscale", 1.0) != 1.0:
            raise MegaUsageError(
                f"--yarn-mscale {model['yarn_mscale']} without --yarn-mscale-all-dim has no"
                " Hugging Face rope_scaling"
            )
        return config
    if model.get("rotary_seq_len_interpolation_factor") is not None:
        return {
            "rope_type": "linear",
            "factor": float(model["rotary_seq_len_interpolation_factor"]),
        }
    return None


def llama_model_section(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """mega's model section of a Llama-style ``config.json`` (Llama, Mixtral)."""
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise MegaUsageError(f"{where}: {flag} is true; mega's Llama-style GPT has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise MegaUsageError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported")
    h, heads, groups, head_dim = _llama_shape(cfg)
    model = {
        "name": "gpt",
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "ffn_hidden_size": cfg["intermediate_size"],
        "position_embedding_type": "rope",
        **rope_fields(cfg, where),
        "normalization": "RMSNorm",
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "hidden_dropout": 0.0,
        "attention_dropout": cfg.get("attention_dropout", 0.0),
        "add_bias_linear": False,
        "init_method_std": cfg.get("initializer_range", 0.02),
    }
    if cfg.get("max_position_embeddings"):  # rope has no table: the length it was made for
        model["max_position_embeddings"] = cfg["max_position_embeddings"]
    if groups != heads:
        model["num_query_groups"] = groups
    if head_dim != h // heads:
        model["kv_channels"] = head_dim
    return model


def llama_tensors_to_mega(
    cfg: dict[str, Any],
    hf: SourceTensors,
    where: str,
    mlp: Any,
    *,
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> dict[str, LazyTensor]:
    """mega tensors of a Llama-style model: embeddings, attention, norms, output layer; each
    layer's MLP from ``mlp(get, hf_prefix, mega_prefix) -> {mega name: tensor}``. ``qkv_bias``:
    the q/k/v projections' biases (Qwen2); ``qk_norm``: per-head ``q_norm``/``k_norm`` (Qwen3)."""
    h, heads, groups, _ = _llama_shape(cfg)
    tied = tied_output(cfg, hf, "lm_head.weight", "model.embed_tokens.weight", default=False)
    hf.ignore(
        [
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
            for i in range(cfg["num_hidden_layers"])
        ],
        "rope's frequencies (from rope_theta): a buffer old transformers saved, not a weight",
    )

    def get(name: str) -> LazyTensor:
        return _need(hf, name, where)

    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight")}
    for i in range(cfg["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (get(f"{src}self_attn.{x}_proj.weight") for x in "qkv")

        def qkv(q: LazyTensor = q, k: LazyTensor = k, v: LazyTensor = v) -> torch.Tensor:
            return merge_qkv(q.load(), k.load(), v.load(), heads, groups)

        rows = q.shape[0] + k.shape[0] + v.shape[0]
        out[f"{dst}input_layernorm.weight"] = get(f"{src}input_layernorm.weight")
        out[f"{dst}self_attention.linear_qkv.weight"] = _lazy((rows, h), q.dtype, qkv)
        if qkv_bias:
            biases = [get(f"{src}self_attn.{x}_proj.bias") for x in "qkv"]
            out[f"{dst}self_attention.linear_qkv.bias"] = _lazy(
                (rows,), biases[0].dtype, lambda b=biases: qkv(*b)
            )
        if qk_norm:
            for x in "qk":
                out[f"{dst}self_attention.{x}_layernorm.weight"] = get(
                    f"{src}self_attn.{x}_norm.weight"
                )
        out[f"{dst}self_attention.linear_proj.weight"] = get(f"{src}self_attn.o_proj.weight")
        out[f"{dst}pre_mlp_layernorm.weight"] = get(f"{src}post_attention_layernorm.weight")
        out.update(mlp(get, src, dst))
    out["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not tied:
        out["output_layer.weight"] = get("lm_head.weight")
    return out


def join_gate_up(gate: LazyTensor, up: LazyTensor) -> LazyTensor:
    """SwiGLU's separate gate and up projections -> mega's ``[gate; up]`` fc1 rows."""
    rows = (gate.shape[0] + up.shape[0], *gate.shape[1:])
    return _lazy(rows, gate.dtype, lambda: torch.cat([gate.load(), up.load()], dim=0))


def gate_or_up(fc1: LazyTensor, index: int) -> LazyTensor:
    """Half ``index`` (0 gate, 1 up) of mega's ``[gate; up]`` fc1 rows."""
    shape = (fc1.shape[0] // 2, *fc1.shape[1:])
    return _lazy(shape, fc1.dtype, lambda: fc1.load().chunk(2, dim=0)[index].contiguous())


def llama_to_mega(
    cfg: dict[str, Any], hf: SourceTensors, where: str, **attention: bool
) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``LlamaForCausalLM``; ``attention``: the
    relatives' extras (``qkv_bias``, ``qk_norm``: see :func:`llama_tensors_to_mega`)."""

    def mlp(get: Any, src: str, dst: str) -> dict[str, LazyTensor]:
        gate, up = get(f"{src}mlp.gate_proj.weight"), get(f"{src}mlp.up_proj.weight")
        return {
            f"{dst}mlp.linear_fc1.weight": join_gate_up(gate, up),
            f"{dst}mlp.linear_fc2.weight": get(f"{src}mlp.down_proj.weight"),
        }

    tensors = llama_tensors_to_mega(cfg, hf, where, mlp, **attention)
    return llama_model_section(cfg, where), tensors


def llama_config(model: dict[str, Any], vocab: int, ffn: int) -> dict[str, Any]:
    """The ``config.json`` fields a Llama-style HF model shares with mega's GPT."""
    h, heads = model["hidden_size"], model["num_attention_heads"]
    groups = model.get("num_query_groups") or (1 if model.get("group_query_attention") else heads)
    return {
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": model.get("kv_channels") or h // heads,
        "hidden_act": "silu",
        "rms_norm_eps": model.get("norm_epsilon", 1e-5),
        "rope_theta": float(model.get("rotary_base", 10000)),
        "rope_scaling": rope_scaling_config(model),
        "max_position_embeddings": model.get("max_position_embeddings") or 4096,
        "attention_dropout": model.get("attention_dropout", 0.0),
        "initializer_range": model.get("init_method_std", 0.02),
        "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights", False),
    }


def mega_tensors_to_llama(
    config: dict[str, Any], mega: dict[str, LazyTensor], mlp: Any
) -> dict[str, LazyTensor]:
    """HF tensors of a Llama-style model from mega's (inverse of :func:`llama_tensors_to_mega`)."""
    h, heads, groups, head_dim = _llama_shape(config)
    out = {"model.embed_tokens.weight": mega["embedding.word_embeddings.weight"]}
    for i in range(config["num_hidden_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = mega[f"{src}self_attention.linear_qkv.weight"]
        for index, (x, rows) in enumerate(
            (("q", heads * head_dim), ("k", groups * head_dim), ("v", groups * head_dim))
        ):

            def part(t: LazyTensor = qkv, index: int = index) -> torch.Tensor:
                return split_qkv(t.load(), heads, groups, head_dim)[index]

            out[f"{dst}self_attn.{x}_proj.weight"] = _lazy((rows, h), qkv.dtype, part)
            bias = mega.get(f"{src}self_attention.linear_qkv.bias")
            if bias is not None:  # Qwen2's q/k/v biases

                def bias_part(t: LazyTensor = bias, index: int = index) -> torch.Tensor:
                    return split_qkv(t.load(), heads, groups, head_dim)[index]

                out[f"{dst}self_attn.{x}_proj.bias"] = _lazy((rows,), bias.dtype, bias_part)
        for x in "qk":  # Qwen3's per-head norms
            norm = mega.get(f"{src}self_attention.{x}_layernorm.weight")
            if norm is not None:
                out[f"{dst}self_attn.{x}_norm.weight"] = norm
        out[f"{dst}input_layernorm.weight"] = mega[f"{src}input_layernorm.weight"]
        out[f"{dst}self_attn.o_proj.weight"] = mega[f"{src}self_attention.linear_proj.weight"]
        out[f"{dst}post_attention_layernorm.weight"] = mega[f"{src}pre_mlp_layernorm.weight"]
        out.update(mlp(src, dst))
    out["model.norm.weight"] = mega["decoder.final_layernorm.weight"]
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = mega["output_layer.weight"]
    return out


def mega_to_llama(
    model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int
) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``LlamaForCausalLM`` from a mega GPT."""
    ffn = mega["decoder.layers.0.mlp.linear_fc2.weight"].shape[1]
    config = {
        "architectures": [LLAMA],
        "model_type": "llama",
        **llama_config(model, vocab, ffn),
        "attention_bias": False,
        "mlp_bias": False,
    }

    def mlp(src: str, dst: str) -> dict[str, LazyTensor]:
        fc1 = mega[f"{src}mlp.linear_fc1.weight"]
        return {
            f"{dst}mlp.gate_proj.weight": gate_or_up(fc1, 0),
            f"{dst}mlp.up_proj.weight": gate_or_up(fc1, 1),
            f"{dst}mlp.down_proj.weight": mega[f"{src}mlp.linear_fc2.weight"],
        }

    return config, mega_tensors_to_llama(config, mega, mlp)


def hf_architecture(model: dict[str, Any]) -> str:
    """Which Hugging Face class a mega GPT's config is, or a one-line error naming why none."""
    rope = model.get("position_embedding_type") in ("rope", "yarn")
    rms = model.get("normalization") == "RMSNorm"
    swiglu, bias = bool(model.get("swiglu")), bool(model.get("add_bias_linear", True))
    qkv_bias, qk_norm = bool(model.get("add_qkv_bias")), bool(model.get("qk_layernorm"))
    llama_like = rope and rms and swiglu and not bias
    if model.get("num_experts"):
        if llama_like and not qkv_bias and not qk_norm:
            return MIXTRAL
        raise MegaUsageError(
            f"a mixture-of-experts model converts to Hugging Face as {MIXTRAL} only (rope,"
            f" RMSNorm, SwiGLU, --disable-bias-linear, no --add-qkv-bias or --qk-layernorm):"
            f" position embedding {model.get('position_embedding_type')},"
            f" {model.get('normalization')}, swiglu {swiglu}, biases {bias}, qkv bias"
            f" {qkv_bias}, qk norm {qk_norm}"
        )
    if llama_like and qkv_bias and qk_norm:
        raise MegaUsageError(
            f"--add-qkv-bias with --qk-layernorm has no Hugging Face class ({QWEN2} has the"
            f" biases, {QWEN3} the norms)"
        )
    if llama_like:
        return QWEN2 if qkv_bias else QWEN3 if qk_norm else LLAMA
    if not rope and not rms and not swiglu and bias and not qk_norm:
        _gpt2_attention(model)
        return GPT2
    raise MegaUsageError(
        "this model is neither GPT-2-like (learned positions, LayerNorm, GeLU, biases) nor"
        f" Llama-like (rope, RMSNorm, SwiGLU, --disable-bias-linear): position embedding"
        f" {model.get('position_embedding_type')}, {model.get('normalization')},"
        f" swiglu {swiglu}, biases {bias}, qk norm {qk_norm}"
    )


def _gpt2_attention(model: dict[str, Any]) -> None:
    """GPT-2's attention has one key/value head per query head, each hidden/heads wide: a
    GPT-2-like model with fewer key/value groups or other head sizes has no Hugging Face class
    (Llama's needs rope, RMSNorm and SwiGLU), a one-line error naming the flag."""
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    groups = (model.get("num_query_groups") or 1) if model.get("group_query_attention") else heads
    if groups != heads:
        raise MegaUsageError(
            f"--group-query-attention ({groups} key/value groups for {heads} heads): a GPT-2-like"
            " model (learned positions, LayerNorm, GeLU) has no Hugging Face class with grouped"
            " attention; GPT2LMHeadModel has one key/value head per query head"
        )
    kv = model.get("kv_channels")
    if kv is not None and kv * heads != hidden:
        raise MegaUsageError(
            f"--kv-channels {kv}: GPT2LMHeadModel's heads are hidden size / heads"
            f" ({hidden} / {heads}) wide; a GPT-2-like model with other head sizes has no"
            " Hugging Face class"
        )
