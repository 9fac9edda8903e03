"""The built-in context-parallel communication types, registered like any plugin's: ``p2p``,
``all_gather`` and ``a2a`` (``--cp-comm-type``, Megatron's names). The machinery is library code
(``mega.parallel.context``); this plugin names it. Cheap to import."""

from __future__ import annotations

from typing import Any

from mega import CPCommTypeSpec, hookimpl


def _scale(query: Any) -> float:
    return query.shape[-1] ** -0.5  # the core attention's (SDPA's default)


def _blockwise(attention: Any, *args: Any) -> Any:
    """``attend`` over a blockwise function of ``[b, heads, s, d]`` tensors, its blocks those of
    the model's attention kernel (``--attention-backend``: ``AttentionKernelSpec.blocks``)."""
    from mega.parallel.attention_kernels import kernel_of

    def attend(query: Any, key: Any, value: Any, core_attention: Any) -> Any:
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        blocks = kernel_of(core_attention).blocks
        context = attention(q, k, v, *args, _scale(query), blocks)  # [b, h, s_local, d]
        return context.transpose(1, 2).reshape(*query.shape[:2], -1)

    return attend


def _p2p(group: Any, rank: int, size: int, peers: tuple[int, int]) -> Any:
    from mega.parallel.context.ring import ring_attention

    return _blockwise(ring_attention, group, peers, rank, size)


def _all_gather(group: Any, rank: int, size: int, peers: tuple[int, int]) -> Any:
    from mega.parallel.context.gather import gathered_attention

    return _blockwise(gathered_attention, group, rank, size)


def _a2a(group: Any, rank: int, size: int, peers: tuple[int, int]) -> Any:
    from mega.parallel.context.ulysses import ulysses_attention

    def attend(query: Any, key: Any, value: Any, core_attention: Any) -> Any:
        def whole(q: Any, k: Any, v: Any) -> Any:
            return core_attention(q, k, v, None)

        return ulysses_attention(query, key, value, whole, group, size)

    return attend


@hookimpl
def register_parallel_choices(register: Any) -> None:
    register(
        CPCommTypeSpec(
            name="p2p",
            build=_p2p,
            description="ring attention: keys and values pass around the ring, overlapped",
        )
    )
    register(
        CPCommTypeSpec(
            name="all_gather",
            build=_all_gather,
            description="gather all keys and values, attend the local queries",
        )
    )
    register(
        CPCommTypeSpec(
            name="a2a",
            build=_a2a,
            description="Ulysses: all-to-all from a sequence split to a head split and back",
            heads_split=True,
        )
    )
