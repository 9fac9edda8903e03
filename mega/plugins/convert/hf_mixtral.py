"""How Hugging Face's ``MixtralForCausalLM`` lays out the weights of mega's GPT with experts.

Mixtral is a Llama (``hf_layouts``) whose every MLP is a sparse MoE block: a router
``block_sparse_moe.gate`` ``[E, h]`` and per expert ``w1`` (gate), ``w3`` (up) ``[ffn, h]`` and
``w2`` (down) ``[h, ffn]``, as the Hub's checkpoints and transformers 4 store them. mega stacks
the experts: ``mlp.experts.linear_fc1`` ``[E, 2 ffn, h]`` (``[w1; w3]`` rows per expert) and
``linear_fc2`` ``[E, h, ffn]``. transformers 5 holds the same stacks in memory
(``mlp.experts.gate_up_proj``, ``down_proj``); a checkpoint with those names is read too.

The router matches without a conversion: Mixtral's softmax over all experts, top-k, then
renormalised over the k, equals mega's (Megatron's) softmax over the top-k logits. What Mixtral
cannot express is refused by name: experts in some layers only, shared experts, sigmoid or
pre-softmax scores, a top-k scaling factor, Sinkhorn routing. Mixtral runs dropless: a mega model
trained with a capacity factor converts, and Hugging Face then drops no tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.errors import MegaUsageError
from mega.plugins.convert.hf_layouts import (
    MIXTRAL,
    _lazy,
    gate_or_up,
    join_gate_up,
    llama_config,
    llama_model_section,
    llama_tensors_to_mega,
    mega_tensors_to_llama,
)
from mega.plugins.models.common.config import layer_pattern


def _stack(parts: list[LazyTensor]) -> LazyTensor:
    shape = (len(parts), *parts[0].shape)
    return _lazy(shape, parts[0].dtype, lambda: torch.stack([p.load() for p in parts]))


class _LastStack:
    """The stacked tensor read last: an expert's w1, w2, w3 are written one after another, so
    each stack is read once, not three times per expert (and one stack is held at a time)."""

    def __init__(self) -> None:
        self.source: LazyTensor | None = None
        self.values: torch.Tensor | None = None

    def expert(self, stacked: LazyTensor, e: int) -> LazyTensor:
        def load() -> torch.Tensor:
            if self.source is not stacked:
                self.source, self.values = None, None  # free the last one before reading
                self.source, self.values = stacked, stacked.load()
            return self.values[e].contiguous()

        return _lazy(stacked.shape[1:], stacked.dtype, load)


def mixtral_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``MixtralForCausalLM``."""
    if cfg.get("router_jitter_noise"):
        raise MegaUsageError(
            f"{where}: router_jitter_noise {cfg['router_jitter_noise']} is not supported"
        )
    if cfg.get("sliding_window") is not None:
        raise MegaUsageError(
            f"{where}: sliding_window {cfg['sliding_window']} is not supported (mega's attention"
            " sees the whole sequence)"
        )
    experts = cfg["num_local_experts"]
    model = llama_model_section(cfg, where)
    model.update(
        name="moe",
        num_experts=experts,
        moe_ffn_hidden_size=cfg["intermediate_size"],
        moe_router_topk=cfg.get("num_experts_per_tok", 2),
        moe_layer_freq="1",
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.001),
    )

    def mlp(get: Any, src: str, dst: str) -> dict[str, LazyTensor]:
        out = {}
        if f"{src}mlp.experts.gate_up_proj" in hf:  # transformers 5's own names
            out[f"{dst}mlp.router.weight"] = get(f"{src}mlp.gate.weight")
            out[f"{dst}mlp.experts.linear_fc1.weight"] = get(f"{src}mlp.experts.gate_up_proj")
            out[f"{dst}mlp.experts.linear_fc2.weight"] = get(f"{src}mlp.experts.down_proj")
            return out
        moe = f"{src}block_sparse_moe."
        out[f"{dst}mlp.router.weight"] = get(f"{moe}gate.weight")
        fc1 = [
            join_gate_up(get(f"{moe}experts.{e}.w1.weight"), get(f"{moe}experts.{e}.w3.weight"))
            for e in range(experts)
        ]
        fc2 = [get(f"{moe}experts.{e}.w2.weight") for e in range(experts)]
        out[f"{dst}mlp.experts.linear_fc1.weight"] = _stack(fc1)
        out[f"{dst}mlp.experts.linear_fc2.weight"] = _stack(fc2)
        return out

    return model, llama_tensors_to_mega(cfg, hf, where, mlp)


def _refuse_what_mixtral_cannot_hold(model: dict[str, Any]) -> None:
    problems = []
    pattern = layer_pattern(model.get("moe_layer_freq", 1), model["num_layers"])
    if not all(pattern):
        problems.append(f"experts in some layers only (--moe-layer-freq {model['moe_layer_freq']})")
    if model.get("moe_shared_expert_intermediate_size"):
        problems.append("a shared expert (--moe-shared-expert-intermediate-size)")
    if model.get("moe_router_score_function", "softmax") != "softmax":
        problems.append(f"--moe-router-score-function {model['moe_router_score_function']}")
    if model.get("moe_router_pre_softmax"):
        problems.append("--moe-router-pre-softmax (Mixtral renormalises the top-k)")
    if model.get("moe_router_topk_scaling_factor") is not None:
        problems.append("--moe-router-topk-scaling-factor")
    if model.get("moe_router_load_balancing_type") == "sinkhorn":
        problems.append("Sinkhorn routing")
    if problems:
        raise MegaUsageError(f"{MIXTRAL} cannot hold this model: {'; '.join(problems)}")


def mega_to_mixtral(
    model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int
) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``MixtralForCausalLM`` from a mega GPT with experts."""
    _refuse_what_mixtral_cannot_hold(model)
    experts, ffn_rows, _ = mega["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape
    config = {
        "architectures": [MIXTRAL],
        "model_type": "mixtral",
        **llama_config(model, vocab, ffn_rows // 2),
        "num_local_experts": experts,
        "num_experts_per_tok": model.get("moe_router_topk", 2),
        "router_aux_loss_coef": model.get("moe_aux_loss_coeff", 0.0),
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }

    last = _LastStack()

    def mlp(src: str, dst: str) -> dict[str, LazyTensor]:
        moe = f"{dst}block_sparse_moe."
        fc1 = mega[f"{src}mlp.experts.linear_fc1.weight"]
        fc2 = mega[f"{src}mlp.experts.linear_fc2.weight"]
        out = {f"{moe}gate.weight": mega[f"{src}mlp.router.weight"]}
        for e in range(experts):
            out[f"{moe}experts.{e}.w1.weight"] = gate_or_up(last.expert(fc1, e), 0)
            out[f"{moe}experts.{e}.w3.weight"] = gate_or_up(last.expert(fc1, e), 1)
        for e in range(experts):  # after every fc1 piece: each stack is read once
            out[f"{moe}experts.{e}.w2.weight"] = last.expert(fc2, e)
        return out

    return config, mega_tensors_to_llama(config, mega, mlp)
