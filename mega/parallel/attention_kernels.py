"""The attention kernels, one table: what ``--attention-backend NAME`` selects, for the model's
core attention and for context parallelism's blockwise attention alike.

A kernel is an ``AttentionKernelSpec``: ``attend`` computes attention over the whole sequence
(the model's ``CoreAttention`` calls it, and Ulysses CP, which reassembles whole sequences);
``blocks`` names the block implementation ring and all-gather CP use with it
(``mega.parallel.context.blocks``: "cudnn", "flash", "math", or "auto", mega's pick for the device
and dtype), since a block needs its log-sum-exp and a backward that takes the merged one.

Built in (Megatron's names): ``auto`` (PyTorch's SDPA picks), ``flash`` (FlashAttention),
``fused`` (cuDNN's fused attention, what Megatron reaches through Transformer Engine) and
``unfused`` (softmax(QK^T)V in plain math). A plugin adds one through
``register_parallel_choices``; the run installs the registered ones here before it builds the
model (``install``), so a model finds every kernel by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mega.parallel.attention_spec import BLOCKS, AttentionKernelSpec, blocks_problem

__all__ = [
    "BLOCKS", "BUILT_IN", "SDPA_BACKENDS", "AttentionKernelSpec", "attention_kernel", "install",
    "kernel_of",
]  # fmt: skip


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    causal: bool,
) -> torch.Tensor:
    """``AttentionKernelSpec.attend`` through ``scaled_dot_product_attention``, its kernels
    PyTorch's choice."""
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=mask is None and causal,
        enable_gqa=query.shape[1] != key.shape[1],  # only when needed: not every kernel has it
    )


def _limited_to(*backends: SDPBackend) -> Callable[..., torch.Tensor]:
    """``_attend`` with SDPA limited to ``backends``."""

    def attend(*args: Any) -> torch.Tensor:
        with sdpa_kernel(list(backends)):
            return _attend(*args)

    return attend


# the built-in names that limit SDPA to some of its kernels ("auto" leaves the choice to it)
SDPA_BACKENDS: dict[str, tuple[SDPBackend, ...]] = {
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION,),
    "unfused": (SDPBackend.MATH,),
}
# name, attend, the blocks context parallelism computes with it, description
_BUILT_IN_ROWS = (
    ("auto", _attend, "auto", "PyTorch's choice (cuDNN on Hopper with torch 2.11)"),
    ("flash", _limited_to(*SDPA_BACKENDS["flash"]), "flash", "FlashAttention (SDPA's)"),
    ("fused", _limited_to(*SDPA_BACKENDS["fused"]), "cudnn", "cuDNN's fused attention"),
    ("unfused", _limited_to(*SDPA_BACKENDS["unfused"]), "math", "softmax(QK^T)V"),
)
BUILT_IN: dict[str, AttentionKernelSpec] = {
    name: AttentionKernelSpec(name=name, attend=attend, blocks=blocks, description=description)
    for name, attend, blocks, description in _BUILT_IN_ROWS
}

# name -> kernel: the built-in ones and, once a run installed them, its plugins'
_TABLE: dict[str, AttentionKernelSpec] = dict(BUILT_IN)


def install(registered: Any) -> None:
    """Make the kernels of a plugin registry (``Plugins.choices("attention kernel")``) the
    table's besides the built-in ones (the previous run's plugin kernels leave)."""
    _TABLE.clear()
    _TABLE.update(BUILT_IN)
    for name in registered.names():
        spec = registered.get(name)
        problem = blocks_problem(spec)
        if problem:  # checked before launch (mega.parallel.checks); a library caller may not
            raise ValueError(problem)
        _TABLE[name] = spec


def attention_kernel(name: str) -> AttentionKernelSpec:
    """The kernel ``--attention-backend name`` selects."""
    if name not in _TABLE:
        raise ValueError(
            f"--attention-backend {name!r}: no such kernel (have: {', '.join(_TABLE)})"
        )
    return _TABLE[name]


def kernel_of(core_attention: Any) -> AttentionKernelSpec:
    """The kernel of a model's core attention, through the wrappers parallelism puts around it
    (the tensor-parallel RNG's, recompute's); ``auto`` for a module that names none."""
    for module in core_attention.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, AttentionKernelSpec):
            return kernel
    return BUILT_IN["auto"]
