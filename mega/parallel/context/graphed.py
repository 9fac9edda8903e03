"""The ring's passes replayed as CUDA graphs (``MEGA_CP_RING_GRAPHS=1``, p2p over NCCL only).

Why: a CP4 rank is host-bound. One H200 running a CP4 rank of the 1.3B GPT at 16k alone (fake
process group) spent 685 us of host time per ring forward and 952 us per backward (four steps of
sends, block kernels, merges and accumulator adds each), 192 of each per step, while its GPU
idled; on 4 GPUs one late host delays its neighbours' next block (docs/context-parallelism.md).
A graph replays the whole pass's launches at once.

How: a pass (``ring._forward_body`` or ``_backward_body``) is keyed by its tensors' shapes,
strides and dtypes and its other arguments (one key per layer shape and direction: every layer
of a model shares it). The first call of a key runs eager, which compiles the merge kernel,
plans the attention kernels and sets up NCCL's peer connections, none of which may happen
during a capture. The second captures the pass on static copies of its inputs, and from then on
a call copies its inputs into them, replays, and returns copies of the outputs (the next replay
overwrites the graph's own). Those copies are the price: on the rank above about 0.27 GB a
forward and backward, some 30 ms a step at the H200's bandwidth, against the host time saved.

What must hold: nothing in a pass reads the host (no ``.item()``, no shape from data), and the
lanes are NCCL send/recv (the copy-engine lane's inbox grows by a rendezvous; :mod:`.validate`
refuses the pair). Captured NCCL calls need NCCL's graph support (CUDA 11.3+, any recent NCCL).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from mega.errors import MegaRunError, first_line
from mega.parallel.context.transport_choice import GRAPHS_ENV, graphs_chosen


class _Pass:
    """One key's graph: its static inputs, the captured outputs, and how many calls it saw."""

    def __init__(self) -> None:
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs: tuple[torch.Tensor, ...] = ()

    def capture(self, body: Callable[..., tuple], args: tuple) -> None:
        # the inputs' strides where they are dense (views of [b, s, h, d] stay so), else
        # contiguous (an expanded gradient cannot be copied into its own layout)
        self.inputs = [torch.empty_like(a) for a in args if isinstance(a, torch.Tensor)]
        static = iter(self.inputs)
        static_args = tuple(next(static) if isinstance(a, torch.Tensor) else a for a in args)
        self.graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: backward captures on autograd's device thread while the main waits
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outputs = body(*static_args)
        except Exception as exc:  # a run that asked for graphs does not silently go without
            raise MegaRunError(
                f"{GRAPHS_ENV}=1: capturing the ring's {body.__name__} as a CUDA graph failed"
                f" ({first_line(exc)}); run without it"
            ) from exc

    def replay(self, args: tuple) -> tuple[torch.Tensor, ...]:
        tensors = (a for a in args if isinstance(a, torch.Tensor))
        for static, given in zip(self.inputs, tensors, strict=True):
            static.copy_(given)
        self.graph.replay()
        return tuple(out.clone(memory_format=torch.preserve_format) for out in self.outputs)


class GraphedPass:
    """``body`` (a ring pass returning a tuple of tensors) run eager once per key, then captured
    and replayed (see the module docstring). Where a call's tensors are not on a GPU, or the
    environment does not ask for graphs, ``body`` runs as it is."""

    def __init__(self, body: Callable[..., tuple]) -> None:
        self.body = body
        self.passes: dict[tuple, _Pass] = {}
        _ALL.add(self)

    def __call__(self, *args: Any) -> tuple:
        first = args[0]
        if not (graphs_chosen() and first.is_cuda) or torch.cuda.is_current_stream_capturing():
            return self.body(*args)
        key = tuple(
            (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
            for a in args
        )
        entry = self.passes.setdefault(key, _Pass())
        entry.calls += 1
        if entry.calls == 1:  # warm: kernels compiled and planned, NCCL peers connected
            return self.body(*args)
        if entry.graph is None:
            entry.capture(self.body, args)
        return entry.replay(args)


_ALL: weakref.WeakSet[GraphedPass] = weakref.WeakSet()


def release_graphs() -> None:
    """Destroy every captured pass's graph, before the process group is destroyed. Why: NCCL
    counts the graphs that captured a communicator's kernels and its destroy waits until each
    is destroyed (``commDestroySync`` spins on ``localPersistentRefs``); graphs kept to the
    interpreter's exit hung ``destroy_process_group`` on 2 H200 (2026-11-29: every rank's
    training done, each stuck there). Waits for the GPU first: after a normal end only
    (:func:`mega.parallel.distributed.finish_job`). The next call of a key runs eager and
    captures anew."""
    for graphed in list(_ALL):
        if any(entry.graph is not None for entry in graphed.passes.values()):
            torch.cuda.synchronize()  # no replay still running on the graphs being destroyed
        for entry in graphed.passes.values():
            if entry.graph is not None:
                entry.graph.reset()
        graphed.passes.clear()


def graphed_pass(body: Callable[..., tuple]) -> Callable[..., tuple]:
    """``body`` through a :class:`GraphedPass`, with ``body``'s signature (a custom op built
    on it infers its schema from that)."""
    graphed = GraphedPass(body)

    @functools.wraps(body)
    def run(*args: Any) -> tuple:
        return graphed(*args)

    run.graphed = graphed  # type: ignore[attr-defined]
    return run
