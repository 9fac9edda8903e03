"""How Hugging Face's ``T5ForConditionalGeneration`` lays out the weights of mega's T5, both ways.

Hugging Face holds the original T5: relative position bias tables (in each stack's first
layer), RMSNorm, ReLU MLPs, no biases, a tied output; in mega that is ``--position-embedding-type
relative --normalization RMSNorm --relu --disable-bias-linear``. Two of T5's habits are folded
into the weights instead of becoming flags:

- T5 does not scale its attention scores by ``1/sqrt(d)``; mega (SDPA) does, so the query
  projections are multiplied by ``sqrt(d)`` (exact when ``d`` is a power of 4, as T5's 64 is);
- T5 multiplies the decoder's output by ``d_model^-0.5`` before the tied output layer; that
  scale is folded into the decoder's final RMSNorm weight.

Gated MLPs (T5 v1.1, Flan-T5: ``gated-gelu``) and untied output layers are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.errors import MegaUsageError
from mega.plugins.convert.hf_layouts import (
    _lazy,
    _need,
    merge_qkv,
    refuse_fields,
    split_qkv,
    tied_output,
)
from mega.plugins.models.t5.config import T5Config

T5 = "T5ForConditionalGeneration"
RELATIVE_BIAS = "layer.0.SelfAttention.relative_attention_bias.weight"  # in block 0 of a stack


def _scaled(t: LazyTensor, factor: float) -> LazyTensor:
    return _lazy(t.shape, t.dtype, lambda: t.load() * factor)


def _kv_rows(k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Separate K and V ``[np*d, h]`` -> mega's cross-attention ``linear_kv`` rows: ``[k; v]``
    per head."""
    return torch.stack((k.view(heads, -1, k.shape[-1]), v.view(heads, -1, v.shape[-1])), dim=1)


# T5Config fields that change the function computed, and what mega's T5 computes (the sizes,
# relative_attention_*, layer_norm_epsilon and tie_word_embeddings are read; dropout is not math)
T5_FIELDS = (
    ("feed_forward_proj", "relu", ("relu",)),  # gated-gelu: T5 v1.1, Flan-T5
    ("is_decoder", False, (False,)),  # a decoder-only T5 is another model
)
WORD_COPIES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def t5_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``T5ForConditionalGeneration`` (tied output)."""
    refuse_fields(cfg, T5_FIELDS, where)
    word = next((name for name in WORD_COPIES if name in hf), WORD_COPIES[0])
    if not tied_output(cfg, hf, "lm_head.weight", word, default=True):
        raise MegaUsageError(
            f"{where}: lm_head.weight is untied from the embeddings (tie_word_embeddings"
            " false); mega's T5 ties its output"
        )
    # transformers ties both stacks' embed_tokens to shared.weight, whatever the files hold
    hf.ignore([n for n in WORD_COPIES if n != word], f"transformers ties it to {word}")
    h, heads, d = cfg["d_model"], cfg["num_heads"], cfg["d_kv"]
    encoder_layers = cfg["num_layers"]
    decoder_layers = cfg.get("num_decoder_layers") or encoder_layers
    model = {
        "name": "t5",
        "num_layers": encoder_layers,
        "encoder_num_layers": encoder_layers,
        "decoder_num_layers": decoder_layers,
        "hidden_size": h,
        "num_attention_heads": heads,
        "kv_channels": d,
        "ffn_hidden_size": cfg["d_ff"],
        "position_embedding_type": "relative",
        "relative_attention_num_buckets": cfg.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": cfg.get("relative_attention_max_distance", 128),
        "normalization": "RMSNorm",
        "norm_epsilon": cfg.get("layer_norm_epsilon", 1e-6),
        "relu": True,
        "swiglu": False,
        "add_bias_linear": False,
        "hidden_dropout": cfg.get("dropout_rate", 0.1),
        "attention_dropout": cfg.get("dropout_rate", 0.1),
    }

    def get(name: str) -> LazyTensor:
        return _need(hf, name, where)

    query_scale = math.sqrt(d)  # module docstring
    out = {"embedding.word_embeddings.weight": get(word)}
    for stack in ("encoder", "decoder"):
        out[f"{stack}_relative_pos_emb.relative_attention_bias.weight"] = get(
            f"{stack}.block.0.{RELATIVE_BIAS}"
        )
    for stack, layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        for i in range(layers):
            src, dst = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            q, k, v = (get(f"{src}0.SelfAttention.{x}.weight") for x in "qkv")

            def qkv(q: LazyTensor = q, k: LazyTensor = k, v: LazyTensor = v) -> torch.Tensor:
                return merge_qkv(q.load() * query_scale, k.load(), v.load(), heads, heads)

            out[f"{dst}input_layernorm.weight"] = get(f"{src}0.layer_norm.weight")
            out[f"{dst}self_attention.linear_qkv.weight"] = _lazy((3 * heads * d, h), q.dtype, qkv)
            out[f"{dst}self_attention.linear_proj.weight"] = get(f"{src}0.SelfAttention.o.weight")
            mlp = "1"
            if stack == "decoder":
                mlp = "2"
                cross = f"{src}1.EncDecAttention."
                ck, cv = get(f"{cross}k.weight"), get(f"{cross}v.weight")

                def kv(k: LazyTensor = ck, v: LazyTensor = cv) -> torch.Tensor:
                    return _kv_rows(k.load(), v.load(), heads).reshape(-1, h)

                out[f"{dst}pre_cross_attn_layernorm.weight"] = get(f"{src}1.layer_norm.weight")
                out[f"{dst}cross_attention.linear_q.weight"] = _scaled(
                    get(f"{cross}q.weight"), query_scale
                )
                out[f"{dst}cross_attention.linear_kv.weight"] = _lazy(
                    (2 * heads * d, h), ck.dtype, kv
                )
                out[f"{dst}cross_attention.linear_proj.weight"] = get(f"{cross}o.weight")
            out[f"{dst}pre_mlp_layernorm.weight"] = get(f"{src}{mlp}.layer_norm.weight")
            out[f"{dst}mlp.linear_fc1.weight"] = get(f"{src}{mlp}.DenseReluDense.wi.weight")
            out[f"{dst}mlp.linear_fc2.weight"] = get(f"{src}{mlp}.DenseReluDense.wo.weight")
    out["encoder.final_layernorm.weight"] = get("encoder.final_layer_norm.weight")
    # the tied output's d_model^-0.5, folded into the norm in front of it
    out["decoder.final_layernorm.weight"] = _scaled(get("decoder.final_layer_norm.weight"), h**-0.5)
    return model, out


def _refusals(cfg: T5Config) -> list[str]:
    """Why a mega T5 is not a ``T5ForConditionalGeneration``, one reason per flag."""
    wanted = {
        "position_embedding_type": ("relative", "--position-embedding-type relative"),
        "normalization": ("RMSNorm", "--normalization RMSNorm"),
        "relu": (True, "--relu"),
        "add_bias_linear": (False, "--disable-bias-linear"),
    }
    return [f"{T5} needs {need}" for name, (v, need) in wanted.items() if getattr(cfg, name) != v]


def mega_to_t5(model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``T5ForConditionalGeneration`` from a mega T5."""
    cfg = T5Config(**{name: value for name, value in model.items() if name != "name"})
    problems = _refusals(cfg)
    if problems:
        raise MegaUsageError("; ".join(problems))
    h, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_kv_channels()
    encoder_layers, decoder_layers = cfg.resolved_encoder_layers(), cfg.resolved_decoder_layers()
    config = {
        "architectures": [T5],
        "model_type": "t5",
        "vocab_size": vocab,
        "d_model": h,
        "d_kv": d,
        "d_ff": cfg.resolved_ffn_hidden_size(),
        "num_layers": encoder_layers,
        "num_decoder_layers": decoder_layers,
        "num_heads": heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "dropout_rate": cfg.hidden_dropout,
        "layer_norm_epsilon": cfg.norm_epsilon,
        "initializer_factor": 1.0,
        "feed_forward_proj": "relu",
        "is_encoder_decoder": True,
        "tie_word_embeddings": True,
        "decoder_start_token_id": 0,
    }
    unscale = 1.0 / math.sqrt(d)
    out = {"shared.weight": mega["embedding.word_embeddings.weight"]}
    for stack, layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        out[f"{stack}.block.0.{RELATIVE_BIAS}"] = mega[
            f"{stack}_relative_pos_emb.relative_attention_bias.weight"
        ]
        for i in range(layers):
            src, dst = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            qkv = mega[f"{src}self_attention.linear_qkv.weight"]
            for index, x in enumerate("qkv"):

                def part(t: LazyTensor = qkv, index: int = index) -> torch.Tensor:
                    values = split_qkv(t.load(), heads, heads, d)[index]
                    return values * unscale if index == 0 else values

                out[f"{dst}0.SelfAttention.{x}.weight"] = _lazy((heads * d, h), qkv.dtype, part)
            out[f"{dst}0.layer_norm.weight"] = mega[f"{src}input_layernorm.weight"]
            out[f"{dst}0.SelfAttention.o.weight"] = mega[f"{src}self_attention.linear_proj.weight"]
            mlp = "1"
            if stack == "decoder":
                mlp = "2"
                cross = f"{dst}1.EncDecAttention."
                kv = mega[f"{src}cross_attention.linear_kv.weight"]
                for index, x in enumerate("kv"):

                    def half(t: LazyTensor = kv, index: int = index) -> torch.Tensor:
                        rows = t.load().view(heads, 2, d, h)[:, index]
                        return rows.reshape(heads * d, h).contiguous()

                    out[f"{cross}{x}.weight"] = _lazy((heads * d, h), kv.dtype, half)
                out[f"{dst}1.layer_norm.weight"] = mega[f"{src}pre_cross_attn_layernorm.weight"]
                out[f"{cross}q.weight"] = _scaled(
                    mega[f"{src}cross_attention.linear_q.weight"], unscale
                )
                out[f"{cross}o.weight"] = mega[f"{src}cross_attention.linear_proj.weight"]
            out[f"{dst}{mlp}.layer_norm.weight"] = mega[f"{src}pre_mlp_layernorm.weight"]
            out[f"{dst}{mlp}.DenseReluDense.wi.weight"] = mega[f"{src}mlp.linear_fc1.weight"]
            out[f"{dst}{mlp}.DenseReluDense.wo.weight"] = mega[f"{src}mlp.linear_fc2.weight"]
    out["encoder.final_layer_norm.weight"] = mega["encoder.final_layernorm.weight"]
    out["decoder.final_layer_norm.weight"] = _scaled(
        mega["decoder.final_layernorm.weight"], math.sqrt(h)
    )
    return config, out
