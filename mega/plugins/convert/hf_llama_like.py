"""Llama's relatives that people fine-tune: ``MistralForCausalLM`` (Llama's layout and
function; a sliding window that would act is refused), ``Phi3ForCausalLM`` (Llama's function
with fused ``qkv_proj`` and ``gate_up_proj``), ``Qwen2ForCausalLM`` (q/k/v biases:
``--add-qkv-bias``) and ``Qwen3ForCausalLM`` (per-head RMSNorm of queries and keys:
``--qk-layernorm``). The tensors map as Llama's (``hf_layouts``), with the biases joined into
mega's grouped QKV rows like the weights.

A mega GPT exports as Qwen2 with ``--add-qkv-bias``, as Qwen3 with ``--qk-layernorm``, else as
Llama: a Mistral comes back as a ``LlamaForCausalLM`` with the same tensors (mega keeps no
record of the source's class, and the two compute the same function without a window), a Phi-3
as one with its fused projections split.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from mega.core.convert.weights import LazyTensor, SourceTensors
from mega.errors import MegaUsageError
from mega.plugins.convert.hf_layouts import (
    QWEN2,
    QWEN3,
    _lazy,
    _llama_shape,
    _need,
    llama_model_section,
    llama_tensors_to_mega,
    llama_to_mega,
    mega_to_llama,
    refuse_fields,
)


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


# Phi3Config fields that change the function, beyond Llama's (rope_scaling longrope is refused
# with the other rope types; original_max_position_embeddings is read by longrope only)
PHI3_FIELDS = (("partial_rotary_factor", 1.0, (1.0,)),)  # rotary on part of the head dim


class _SplitPhi3(Mapping[str, LazyTensor]):
    """Phi-3's tensors as a Llama's: each layer's fused ``qkv_proj`` ``[q; k; v]`` rows seen as
    ``q_proj``/``k_proj``/``v_proj``; the rest (and ``ignore``) go to the source."""

    def __init__(self, cfg: dict[str, Any], hf: SourceTensors, where: str) -> None:
        self.hf, self.split = hf, {}
        _, heads, groups, d = _llama_shape(cfg)
        rows = {"q": heads * d, "k": groups * d, "v": groups * d}
        for i in range(cfg["num_hidden_layers"]):
            prefix = f"model.layers.{i}.self_attn."
            fused = _need(hf, f"{prefix}qkv_proj.weight", where)
            start = 0
            for x, count in rows.items():
                # each part reads the fused tensor: one tensor in memory at a time, 3 reads
                def part(t: LazyTensor = fused, a: int = start, b: int = start + count) -> Any:
                    return t.load()[a:b].contiguous()

                shape = (count, *fused.shape[1:])
                self.split[f"{prefix}{x}_proj.weight"] = _lazy(shape, fused.dtype, part)
                start += count

    def __getitem__(self, name: str) -> LazyTensor:
        return self.split[name] if name in self.split else self.hf[name]

    def __contains__(self, name: object) -> bool:
        return name in self.split or name in self.hf

    def __iter__(self) -> Iterator[str]:
        return iter([*self.split, *self.hf])

    def __len__(self) -> int:
        return len(self.split) + len(self.hf)

    def ignore(self, names: Any, reason: str) -> None:
        self.hf.ignore(names, reason)


def phi3_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``Phi3ForCausalLM`` (Phi-3, Phi-4) without an
    acting window or partial rotary: Llama's function, its q/k/v and gate/up projections fused
    (``gate_up_proj``'s ``[gate; up]`` rows are mega's fc1 as they are)."""
    refuse_fields(cfg, PHI3_FIELDS, where)
    refuse_acting_window(cfg, where)

    def mlp(get: Any, src: str, dst: str) -> dict[str, LazyTensor]:
        return {
            f"{dst}mlp.linear_fc1.weight": get(f"{src}mlp.gate_up_proj.weight"),
            f"{dst}mlp.linear_fc2.weight": get(f"{src}mlp.down_proj.weight"),
        }

    split = _SplitPhi3(cfg, hf, where)  # a SourceTensors for the reader: taking, ignore
    tensors = llama_tensors_to_mega(cfg, split, where, mlp)  # type: ignore[arg-type]
    model = llama_model_section(cfg, where)
    model["hidden_dropout"] = cfg.get("resid_pdrop", 0.0)
    return model, tensors


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
