"""The built-in MoE token dispatchers, registered like any plugin's: ``allgather`` and
``alltoall`` and ``flex`` (``--moe-token-dispatcher-type``). The machinery is library code
(``mega.parallel.expert.dispatchers``); this plugin names it. Cheap to import."""

from __future__ import annotations

from typing import Any

from mega import MoEDispatcherSpec, hookimpl


def _allgather(group: Any) -> Any:
    from mega.parallel.expert.dispatchers import AllGatherDispatcher

    return AllGatherDispatcher(group)


def _alltoall(group: Any) -> Any:
    from mega.parallel.expert.dispatchers import AllToAllDispatcher

    return AllToAllDispatcher(group)


def _flex(group: Any) -> Any:
    from mega.parallel.expert.dispatchers import DeviceSplitDispatcher

    return DeviceSplitDispatcher(group)


@hookimpl
def register_parallel_choices(register: Any) -> None:
    register(
        MoEDispatcherSpec(
            name="allgather",
            build=_allgather,
            description="every rank gathers all tokens, runs its experts, reduce-scatters back",
        )
    )
    register(
        MoEDispatcherSpec(
            name="alltoall",
            build=_alltoall,
            description="each routed token travels to its expert's rank and back (all-to-all)",
        )
    )
    register(
        MoEDispatcherSpec(
            name="flex",
            build=_flex,
            description="alltoall's traffic with the counts kept on the GPU: no host sync, one"
            " graph (NVSHMEM on GPUs; dropless)",
            drops_tokens=False,
        )
    )
