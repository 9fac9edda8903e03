"""Micro-batch preparation the encoder models share (BERT's padding mask, T5's encoder mask).
No torch: it runs on the host, on the numpy arrays of a micro-batch."""

from __future__ import annotations

from typing import Any


def without_full_mask(key: str) -> Any:
    """A ``prepare_microbatch`` that drops ``key`` (a padding mask, 1 on tokens) from a
    micro-batch without padding: the model then attends unmasked, on the flash or cuDNN kernels
    that take no mask, and no device-side test (a host sync per micro-batch) is needed."""

    def prepare(arrays: dict[str, Any]) -> dict[str, Any]:
        if arrays[key].all():
            return {name: values for name, values in arrays.items() if name != key}
        return arrays

    return prepare
