"""Llama's relatives that people fine-tune, both ways: ``MistralForCausalLM`` (Llama's layout
and function; a sliding window that would act is refused), ``Qwen2ForCausalLM`` (q/k/v biases:
``--add-qkv-bias``) and ``Qwen3ForCausalLM`` (per-head RMSNorm of queries and keys:
``--qk-layernorm``). The tensors map as Llama's (``hf_layouts``), with the biases joined into
mega's grouped QKV rows like the weights.

A mega GPT exports as Qwen2 with ``--add-qkv-bias``, as Qwen3 with ``--qk-layernorm``, else as
Llama: a Mistral comes back as a ``LlamaForCausalLM`` with the same tensors (mega keeps no
record of the source's class, and the two compute the same function without a window).
"""

from __future__ import annotations

from typing import Any

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.core.errors import MegaUsageError
from mega.plugins.convert.hf_layouts import QWEN2, QWEN3, llama_to_mega, mega_to_llama


def refuse_acting_window(cfg: dict[str, Any], where: str, used: bool = True) -> None:
    """A ``sliding_window`` shorter than ``max_position_embeddings`` would mask keys mega's
    attention sees: one line naming it. ``used``: whether the config turns the window on."""
    window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if used and window is not None and (positions is None or window < positions):
        raise MegaUsageError(
            f"{where}: sliding_window {window} is shorter than max_position_embeddings"
            f" {positions}: the window would act, and mega's attention sees the whole sequence"
        )


def _qwen_window(cfg: dict[str, Any], where: str) -> None:
    # Qwen's window acts only on layers of type sliding_attention (use_sliding_window's)
    used = bool(cfg.get("use_sliding_window")) or "sliding_attention" in (
        cfg.get("layer_types") or []
    )
    refuse_acting_window(cfg, where, used)


def mistral_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``MistralForCausalLM`` without an acting window."""
    refuse_acting_window(cfg, where)
    return llama_to_mega(cfg, hf, where)


def qwen2_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5)."""
    _qwen_window(cfg, where)
    model, tensors = llama_to_mega(cfg, hf, where, qkv_bias=True)
    model["add_qkv_bias"] = True
    return model, tensors


def qwen3_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a dense ``Qwen3ForCausalLM``."""
    _qwen_window(cfg, where)
    model, tensors = llama_to_mega(cfg, hf, where, qk_norm=True)
    model["qk_layernorm"] = True
    return model, tensors


def _qwen_config(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    # no window: transformers then makes every layer full_attention (layer_types, and
    # max_window_layers at its default, which nothing reads without a window)
    config.pop("mlp_bias")
    if architecture == QWEN2:
        config.pop("attention_bias")  # Qwen2's q/k/v always have biases, o_proj none
    config.update(
        architectures=[architecture],
        model_type=architecture.removesuffix("ForCausalLM").lower(),
        use_sliding_window=False,
        sliding_window=None,
    )
    return config


def mega_to_qwen2(
    model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int
) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``Qwen2ForCausalLM`` from a mega GPT with --add-qkv-bias."""
    config, tensors = mega_to_llama(model, mega, vocab)
    return _qwen_config(config, QWEN2), tensors


def mega_to_qwen3(
    model: dict[str, Any], mega: dict[str, LazyTensor], vocab: int
) -> tuple[dict, dict]:
    """(config.json, HF tensors) of a ``Qwen3ForCausalLM`` from a mega GPT with --qk-layernorm."""
    config, tensors = mega_to_llama(model, mega, vocab)
    return _qwen_config(config, QWEN3), tensors
