"""The ``flex`` dispatcher's steps, and their order with and without overlap.

A chunk of this rank's tokens goes through five steps: its slots sorted by expert (``leave``),
the trip out (``dispatch_rows``), the experts on the arrived blocks, the trip back
(``combine_rows``), and the outputs weighted back into tokens (``mix``). Without overlap the
whole micro-batch is one chunk, its steps in order on the current stream: every trip is exposed
(on 2 H200, 2026-11-29, flex's trips took 97 of an EP2 step's 280 profiled ms, nothing beside
them).

With ``--overlap-moe-expert-parallel-comm`` the tokens are two chunks and the trips run on a
side stream: the host launches the out-trips of both chunks, then both chunks' experts on the
compute stream (each after its own out-trip), then both back-trips on the side stream (each
after its own chunk's experts). So the second chunk's out-trip runs beside the first chunk's
experts, and the first chunk's back-trip beside the second's. Backward ops run on the stream of
their forward op (autograd's stream semantics), so the trips' gradients (the reverse trips) are
on the side stream too and the engine's order (last forward op first) hides the first chunk's
backward out-trip behind the second chunk's experts' backward, and the second chunk's backward
back-trip behind the first's. On the CPU (and the meta device) there are no streams: the same
steps run in the same order, one after another, which is how the CPU suite checks the chunking.
The experts of a chunk run half the rows, and the overlapped part runs eager inside a compiled
layer (streams are not traced): on 2 H200 it trained EP2 at 0.479x DP2 against 0.854x in order.

So where the trips are padded and the layer is one graph (the grouped GEMM on a GPU) the flag
runs :func:`pipelined` instead: the same two chunks on one stream, each trip begun early and
ended late, traced into the layer's graph (its docstring says why only there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mega.parallel.expert import padded_exchange as px
from mega.parallel.expert.local import (
    experts_on_prefix,
    group_by_expert,
    mix_slots,
    to_experts,
    to_slots,
)
from mega.parallel.expert.split_exchange import (
    block_rows,
    combine_rows,
    dispatch_rows,
    expert_groups,
    sent_rows,
    split_in_pieces,
)
from mega.parallel.expert.validate import padded_trips


@dataclass
class Chunk:
    """One chunk of tokens on its way: ``t`` tokens of ``k`` slots each, the slots' sort
    (``order``, ``inverse``), the pieced splits and the rows in expert order (``rows``), then
    what each step adds."""

    t: int
    k: int
    probs: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    splits: torch.Tensor
    rows: torch.Tensor
    arrived: torch.Tensor | None = None
    layout: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    returned: torch.Tensor | None = None


@dataclass(frozen=True)
class Shape:
    """The exchange's shape: ``n`` ranks of ``local`` experts, each block in ``pieces``."""

    group: Any
    n: int
    local: int
    pieces: int
    name: str = ""  # the group's name (the pipelined schedule's raw collectives take it)

    @property
    def sub_experts(self) -> int:
        return self.local * self.pieces


def leave(tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, s: Shape) -> Chunk:
    """The chunk's slots sorted by global expert, the rows per (rank, expert) block, dropless
    (``bounds[0]`` is 0), each block cut in pieces that travel as sub-experts."""
    t, k = indices.shape
    order, inverse, bounds = group_by_expert(indices.reshape(-1), s.n * s.local)
    splits = split_in_pieces(bounds.diff(), s.pieces)
    return Chunk(t, k, probs, order, inverse, splits, to_experts(tokens, order, inverse, k))


def trip_out(c: Chunk, s: Shape) -> None:
    c.arrived, c.layout = dispatch_rows(c.rows, c.splits, s.group, s.sub_experts)


def run_experts(c: Chunk, s: Shape, experts: Any) -> None:
    arrived = c.arrived
    # NVSHMEM's buffer keeps an earlier trip's rows in its padding, and a grouped GEMM group may
    # hold padding rows: zero them (c10d's and the padded transport's are zero already)
    if arrived.is_cuda and not padded_trips(arrived.device):
        held = block_rows(c.layout, arrived.shape[0]).unsqueeze(1)
        arrived = torch.where(held, arrived, arrived.new_zeros(()))
    # each expert's rows: its pieces' blocks, which lie together, and padding among them
    groups = expert_groups(c.layout, s.n * s.pieces, s.local)
    c.outputs = experts_on_blocks(arrived, groups, experts, s.n, s.sub_experts)


def trip_back(c: Chunk, s: Shape) -> None:
    c.returned = combine_rows(c.outputs, c.layout, c.splits, s.group, s.sub_experts)


def mix(c: Chunk, dtype: torch.dtype) -> torch.Tensor:
    return mix_slots(to_slots(c.returned, c.order, c.inverse).view(c.t, c.k, -1), c.probs, dtype)


def experts_on_blocks(
    arrived: torch.Tensor, counts: torch.Tensor, experts: Any, n: int, local: int
) -> torch.Tensor:
    """The experts' outputs for ``arrived``'s rows in groups of ``counts`` (each expert's blocks
    and the zeroed padding rows among them, if any), the rows past the groups included
    (:func:`~mega.parallel.expert.local.experts_on_prefix`). On meta (the planner) the routing
    is balanced: ``S`` rows arrive."""
    meta_rows = sent_rows(arrived.shape[0], n, local, arrived.device) if arrived.is_meta else 0
    return experts_on_prefix(arrived, counts, experts, meta_rows)


def in_order(tokens: torch.Tensor, routing: Any, experts: Any, s: Shape) -> torch.Tensor:
    """One chunk, its steps one after another on the current stream."""
    c = leave(tokens, routing.probs, routing.indices, s)
    trip_out(c, s)
    run_experts(c, s, experts)
    trip_back(c, s)
    return mix(c, tokens.dtype)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:  # high priority: the trips' one-block barrier kernels do not queue
        _SIDE[device] = torch.cuda.Stream(device, priority=-1)  # behind the GEMMs' blocks
    return _SIDE[device]


class _Streams:
    """The compute stream and the trips' side stream of a CUDA device, and what moving a tensor
    between them takes (an event to wait on, the allocator told who else uses its memory); on
    other devices nothing: one stream of execution."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.side = _side_stream(device) if self.cuda else None

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.side):
            yield

    def mark(self, on_side: bool) -> torch.cuda.Event | None:
        """An event at this point of the side (or compute) stream."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side if on_side else self.compute)
        return event

    def hand(self, event: torch.cuda.Event | None, to_side: bool, *tensors: Any) -> None:
        """``tensors``, made on one stream up to ``event``, used from now on the other too."""
        if not self.cuda:
            return
        stream = self.side if to_side else self.compute
        stream.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(stream)


# Inductor's default schedule puts each wait right after its collective, whatever the order of
# the code (CPU, torch 2.13, the pipelined layer with the grouped GEMM: every trip waited at
# once); its sink_waits pass moves each wait to just before the first use of its result, which
# is the order written here: both out-trips begun, one chunk's experts, its back-trip begun, the
# other's, forward and backward alike. The pipelined layer is compiled with it.
PIPELINED_COMPILE_OPTIONS = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits"],
}


def pipelined(tokens: torch.Tensor, routing: Any, experts: Any, s: Shape) -> torch.Tensor:
    """Two chunks over the padded trips, each trip begun early and ended late on the one
    stream: both out-trips begun, then for each chunk its out-trip ended, its experts run and
    its back-trip begun, then both back-trips ended. NCCL runs a begun all-to-all on its own
    stream, beside the compute the host queues before its end, so the second chunk's out-trip
    runs beside the first chunk's experts and the first's back-trip beside the second's; the
    backward pairs them the same way in reverse (``padded_exchange._Begun``). No stream is
    switched, so torch.compile traces it whole, into the layer's graph.

    Only where the layer is one graph (:func:`~mega.parallel.expert.local.grouped_on_gpu`; the dispatcher sees to it):
    inductor gives a begun collective's input buffer to later kernels of the same graph when
    that graph holds no wait for it, so a graph break between a trip's begin and its end (the
    CPU's expert rows) let the second chunk's rows overwrite the first's while gloo still sent
    them (CPU, torch 2.13, 2026-11-30: outputs 0.63 off). Within one graph the wait keeps its
    collective's input."""
    halves = zip(
        tokens.tensor_split(2),
        routing.probs.tensor_split(2),
        routing.indices.tensor_split(2),
        strict=True,
    )
    first, second = (leave(x, probs, indices, s) for x, probs, indices in halves)
    local = s.sub_experts
    out_first = px.dispatch_begin(first.rows, first.splits, s.name, s.n, local)
    out_second = px.dispatch_begin(second.rows, second.splits, s.name, s.n, local)
    back_first = _experts_between_trips(first, out_first, s, experts)
    back_second = _experts_between_trips(second, out_second, s, experts)
    first.returned = px.combine_end(back_first, first.splits, s.name, s.n, local)
    second.returned = px.combine_end(back_second, second.splits, s.name, s.n, local)
    return torch.cat([mix(first, tokens.dtype), mix(second, tokens.dtype)])


def _experts_between_trips(c: Chunk, begun: Any, s: Shape, experts: Any) -> torch.Tensor:
    """The chunk's out-trip ended, its experts run, its back-trip begun (returned)."""
    c.arrived, c.layout = px.dispatch_end(begun, s.name, s.n, s.sub_experts)
    run_experts(c, s, experts)
    return px.combine_begin(c.outputs, c.layout, s.name, s.n, s.sub_experts)


def overlapped(tokens: torch.Tensor, routing: Any, experts: Any, s: Shape) -> torch.Tensor:
    """Two chunks, their trips on the side stream beside the other chunk's experts (above).
    Under torch.compile it is called eager (the dispatcher marks it): streams are not traced."""
    streams = _Streams(tokens.device)
    halves = zip(
        tokens.tensor_split(2),
        routing.probs.tensor_split(2),
        routing.indices.tensor_split(2),
        strict=True,
    )
    chunks = [leave(x, probs, indices, s) for x, probs, indices in halves]
    sorted_at = streams.mark(on_side=False)
    for c in chunks:
        streams.hand(sorted_at, True, c.rows, c.splits)
    arrivals = []
    with streams.on_side():
        for c in chunks:
            trip_out(c, s)
            arrivals.append(streams.mark(on_side=True))
    done = []
    for c, arrived_at in zip(chunks, arrivals, strict=True):
        streams.hand(arrived_at, False, c.arrived, c.layout)
        run_experts(c, s, experts)
        done.append(streams.mark(on_side=False))
    with streams.on_side():
        for c, done_at in zip(chunks, done, strict=True):
            streams.hand(done_at, True, c.outputs)
            trip_back(c, s)
    back_at = streams.mark(on_side=True)
    for c in chunks:
        streams.hand(back_at, False, c.returned)
    return torch.cat([mix(c, tokens.dtype) for c in chunks])
