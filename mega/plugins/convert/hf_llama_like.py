"""Llama's relatives that people fine-tune: ``MistralForCausalLM`` (Llama's layout and
function; a sliding window that would act is refused). The tensors map as Llama's
(``hf_layouts``).

A Mistral comes back as a ``LlamaForCausalLM`` with the same tensors (mega keeps no record of
the source's class, and the two compute the same function without a window).
"""

from __future__ import annotations

from typing import Any

from mega.core.convert.weights import SourceTensors
from mega.core.errors import MegaUsageError
from mega.plugins.convert.hf_layouts import llama_to_mega


def refuse_acting_window(cfg: dict[str, Any], where: str, used: bool = True) -> None:
    """A ``sliding_window`` shorter than ``max_position_embeddings`` would mask keys mega's
    attention sees: one line naming it. ``used``: whether the config turns the window on."""
    window, positions = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if used and window is not None and (positions is None or window < positions):
        raise MegaUsageError(
            f"{where}: sliding_window {window} is shorter than max_position_embeddings"
            f" {positions}: the window would act, and mega's attention sees the whole sequence"
        )


def mistral_to_mega(cfg: dict[str, Any], hf: SourceTensors, where: str) -> tuple[dict, dict]:
    """(mega model section, mega tensors) of a ``MistralForCausalLM`` without an acting window."""
    refuse_acting_window(cfg, where)
    return llama_to_mega(cfg, hf, where)
