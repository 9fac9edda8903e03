"""Small checkpoint state (counters, schedules, RNG states) as JSON: readable, and loading it can
never run code. Tensors, which only the RNG states hold, become ``{"__tensor__": dtype, "shape":
[...], "base64": bytes}``; tuples become lists."""

from __future__ import annotations

import base64
from typing import Any

_TENSOR = "__tensor__"


def to_json(value: Any) -> Any:
    """``value`` with its tensors encoded (see the module docstring)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        return {
            _TENSOR: str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "base64": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
        }
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json` (tuples come back as lists)."""
    import torch

    if isinstance(value, dict):
        if _TENSOR in value:
            dtype = getattr(torch, value[_TENSOR], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown tensor dtype {value[_TENSOR]!r}")
            raw = bytearray(base64.b64decode(value["base64"]))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return flat.view(dtype).reshape(value["shape"]).clone()
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value
