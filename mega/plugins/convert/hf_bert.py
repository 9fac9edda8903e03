"""How Hugging Face's ``BertForPreTraining`` lays out the weights of mega's BERT, both ways.

Hugging Face's BERT is the original, post-norm one: a layer norm on the embeddings and after
each residual sum. It converts to mega's ``--bert-post-layernorm`` BERT (Megatron's own BERT is
pre-norm, which no weight mapping turns into post-norm). Separate query, key and value become
mega's grouped QKV rows (one group per head); the masked-LM head, pooler and sentence-order
head map one to one. The masked-LM output layer is tied to the word embeddings or not as
``tie_word_embeddings`` says (default true, as transformers'): an untied
``cls.predictions.decoder.weight`` is mega's ``--untie-embeddings-and-output-weights``
``output_layer.weight``, both ways.
"""

from __future__ import annotations

from typing import Any

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
from mega.plugins.models.bert.config import BertConfig

BERT = "BertForPreTraining"

# mega BERT module -> Hugging Face module, apart from QKV (each has a weight and a bias)
EMBEDDING_NORM = ("embedding.layernorm", "bert.embeddings.LayerNorm")
LAYER_MODULES = (
    ("self_attention.linear_proj", "attention.output.dense"),
    ("post_attention_layernorm", "attention.output.LayerNorm"),
    ("mlp.linear_fc1", "intermediate.dense"),
    ("mlp.linear_fc2", "output.dense"),
    ("post_mlp_layernorm", "output.LayerNorm"),
)
HEAD_MODULES = (
    ("lm_head.dense", "cls.predictions.transform.dense"),
    ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"),
    ("pooler.dense", "bert.pooler.dense"),
    ("binary_head", "cls.seq_relationship"),
)
EMBEDDINGS = (
    ("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
    ("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
    ("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
)
OUTPUT_BIAS = ("output_layer.bias", "cls.predictions.bias")
DECODER = "cls.predictions.decoder"  # the masked-LM output layer: its bias is OUTPUT_BIAS
OUTPUT_WEIGHT = ("output_layer.weight", f"{DECODER}.weight")  # untied only
# BertConfig fields that change the function computed, and what mega's BERT computes. Not here:
# dropouts, chunk_size_feed_forward (the same function in chunks), pad_token_id (an embedding
# row's gradient only); sizes, layer_norm_eps and tie_word_embeddings are read.
BERT_FIELDS = (
    ("hidden_act", "gelu", ("gelu",)),
    ("position_embedding_type", "absolute", ("absolute",)),
    ("type_vocab_size", 2, (2,)),
    ("is_decoder", False, (False,)),  # True: causal attention
    ("add_cross_attention", False, (False,)),
    ("pruned_heads", {}, ({},)),
)
BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")  # old files


def bert_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``BertForPreTraining``, tied or untied."""
    refuse_fields(cfg, BERT_FIELDS, where)
    tied = tied_output(cfg, hf, OUTPUT_WEIGHT[1], EMBEDDINGS[0][1], default=True)
    hf.ignore(BUFFERS, "a buffer of position or token type ids, not a weight")
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    model = {
        "name": "bert",
        "num_layers": layers,
        "hidden_size": h,
        "num_attention_heads": heads,
        "ffn_hidden_size": cfg["intermediate_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "norm_epsilon": cfg.get("layer_norm_eps", 1e-12),
        "swiglu": False,
        "openai_gelu": False,
        "hidden_dropout": cfg.get("hidden_dropout_prob", 0.1),
        "attention_dropout": cfg.get("attention_probs_dropout_prob", 0.1),
        "init_method_std": cfg.get("initializer_range", 0.02),
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not tied,
        "bert_binary_head": True,
        "bert_post_layernorm": True,
    }

    def get(name: str) -> LazyTensor:
        return _need(hf, name, where)

    out = {mega: get(name) for mega, name in EMBEDDINGS}
    _copy_modules(out, get, [EMBEDDING_NORM])
    for i in range(layers):
        src, dst = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (get(f"{src}attention.self.{x}.{kind}") for x in ("query", "key", "value"))

            def qkv(q: LazyTensor = q, k: LazyTensor = k, v: LazyTensor = v) -> Any:
                return merge_qkv(q.load(), k.load(), v.load(), heads, heads)

            shape = (3 * q.shape[0], *q.shape[1:])
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _lazy(shape, q.dtype, qkv)
        _copy_modules(out, get, [(dst + m, src + n) for m, n in LAYER_MODULES])
    _copy_modules(out, get, HEAD_MODULES)
    bias = OUTPUT_BIAS[1] if OUTPUT_BIAS[1] in hf else f"{DECODER}.bias"
    out[OUTPUT_BIAS[0]] = get(bias)
    hf.ignore(f"{DECODER}.bias", f"the same parameter as {OUTPUT_BIAS[1]} in transformers")
    if not tied:  # a missing one is refused by name (_need), never replaced by the embeddings
        out[OUTPUT_WEIGHT[0]] = get(OUTPUT_WEIGHT[1])
    return model, out


def _copy_modules(out: dict[str, LazyTensor], get: Any, pairs: Any) -> None:
    """``out[a.weight/bias] = get(b.weight/bias)`` for each module pair ``(a, b)``."""
    for target, source in pairs:
        for kind in ("weight", "bias"):
            out[f"{target}.{kind}"] = get(f"{source}.{kind}")


def _refusals(model: dict[str, Any]) -> list[str]:
    """Why a mega BERT is not a ``BertForPreTraining``, one reason per flag."""
    cfg = BertConfig(**{name: value for name, value in model.items() if name != "name"})
    wanted = {
        "bert_post_layernorm": (True, "--bert-post-layernorm"),
        "bert_binary_head": (True, "the binary head (not --bert-no-binary-head)"),
        "add_bias_linear": (True, "biases (not --disable-bias-linear)"),
        "normalization": ("LayerNorm", "--normalization LayerNorm"),
        "position_embedding_type": ("learned_absolute", "learned absolute positions"),
        "swiglu": (False, "GeLU (not --swiglu)"),
        "openai_gelu": (False, "exact GeLU (not --openai-gelu)"),
        "group_query_attention": (False, "no --group-query-attention"),
    }
    problems = [
        f"{BERT} needs {need}"
        for name, (value, need) in wanted.items()
        if getattr(cfg, name) != value
    ]
    if cfg.resolved_kv_channels() * cfg.num_attention_heads != cfg.hidden_size:
        problems.append(f"{BERT} needs --kv-channels = hidden size / heads")
    return problems


def mega_to_bert(
    model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int
) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``BertForPreTraining`` from a mega BERT."""
    problems = _refusals(model)
    if problems:
        raise MegaUsageError("; ".join(problems))
    h, layers, heads = model["hidden_size"], model["num_layers"], model["num_attention_heads"]
    d = h // heads
    dropout = model.get("hidden_dropout", 0.1)
    config = {
        "architectures": [BERT],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": mega["encoder.layers.0.mlp.linear_fc1.weight"].shape[0],
        "hidden_act": "gelu",
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": model.get("attention_dropout", dropout),
        "max_position_embeddings": mega["embedding.position_embeddings.weight"].shape[0],
        "type_vocab_size": 2,
        "initializer_range": model.get("init_method_std", 0.02),
        "layer_norm_eps": model.get("norm_epsilon", 1e-5),
        "position_embedding_type": "absolute",
        "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights", False),
    }
    out = {name: mega[target] for target, name in EMBEDDINGS}
    _copy_modules(out, mega.__getitem__, [EMBEDDING_NORM[::-1]])
    for i in range(layers):
        src, dst = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            qkv = mega[f"{src}self_attention.linear_qkv.{kind}"]
            for index, x in enumerate(("query", "key", "value")):

                def part(t: LazyTensor = qkv, index: int = index) -> Any:
                    return split_qkv(t.load(), heads, heads, d)[index]

                shape = (qkv.shape[0] // 3, *qkv.shape[1:])
                out[f"{dst}attention.self.{x}.{kind}"] = _lazy(shape, qkv.dtype, part)
        _copy_modules(out, mega.__getitem__, [(dst + n, src + m) for m, n in LAYER_MODULES])
    _copy_modules(out, mega.__getitem__, [(n, m) for m, n in HEAD_MODULES])
    out[OUTPUT_BIAS[1]] = mega[OUTPUT_BIAS[0]]
    if not config["tie_word_embeddings"]:
        out[OUTPUT_WEIGHT[1]] = mega[OUTPUT_WEIGHT[0]]
    return config, out
