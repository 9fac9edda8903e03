"""What an attention kernel is (``AttentionKernelSpec``) and the built-in kernels' names: torch-
free, so that registering a kernel and checking ``--attention-backend`` stay cheap. The kernels
themselves and their table: ``mega.parallel.attention_kernels``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

# the block implementations context parallelism has (mega.parallel.context.blocks)
BLOCKS = ("auto", "cudnn", "flash", "math")
# the built-in kernels (Megatron's --attention-backend names)
BUILT_IN_NAMES = ("auto", "flash", "fused", "unfused")


@dataclass(frozen=True, kw_only=True)
class AttentionKernelSpec:
    """An attention kernel, selected by ``--attention-backend NAME``.

    ``attend(query, key, value, mask, dropout_p, causal)``: ``query [b, heads, s, d]``,
    ``key``/``value [b, groups, s_k, d]`` (grouped-query attention when groups < heads: query
    head ``i`` reads group ``i // (heads/groups)``), ``mask`` None or broadcast to
    ``[b, heads, s, s_k]`` (bool: True where attention is allowed; float: added to the scores),
    ``causal`` (with no mask: each position sees those up to itself) -> ``[b, heads, s, d]`` in
    the inputs' dtype, differentiable. ``blocks``: the block implementation context
    parallelism's ring and all-gather types use with this kernel (one of ``BLOCKS``).
    """

    choice_kind: ClassVar[str] = "attention kernel"  # its registry (register_parallel_choices)
    name: str
    attend: Callable[..., Any]
    blocks: str = "auto"
    description: str = ""


def blocks_problem(spec: AttentionKernelSpec) -> str | None:
    """Why a kernel's ``blocks`` cannot be used (one of ``BLOCKS`` it must be), or None."""
    if spec.blocks in BLOCKS:
        return None
    return (
        f"attention kernel '{spec.name}': blocks {spec.blocks!r} is not one of {', '.join(BLOCKS)}"
    )
