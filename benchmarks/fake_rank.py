"""Run ``mega`` as rank 0 of a larger job on this one GPU, over torch's fake process group:
every collective returns at once, so a layout's step time is one rank's compute alone (its
kernels and launches, no communication). What a multi-GPU layout costs beside its collectives,
measured on one GPU (``parallel_layouts.py --fake-world``).

    WORLD_SIZE=2 python benchmarks/fake_rank.py train ... --nproc-per-node 2 \
        --tensor-model-parallel-size 2 --sequence-parallel

The fake group writes nothing into a gather's, reduce-scatter's or all-to-all's output, which would
leave uninitialised memory (NaNs now and then) in the activations: each rank's slice of the output
is this rank's input instead, one copy, as many bytes as the real collective writes. That holds
for the in-place c10d calls (``mega.parallel.comm``) and for the functional collectives the
model's layers compile (``mega.parallel.functional_comm``: tensor-parallel mappings, the overlapped
all-gather, the expert all-to-all; through an opaque op, :func:`stand_in`, so that compiled
graphs keep it); without the second a TP + SP rank's first gradient norm was NaN.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def fill_like_the_collectives() -> None:
    from mega.parallel import comm

    gather, scatter = comm._ALL_GATHER, comm._REDUCE_SCATTER

    def all_gather(out: torch.Tensor, inp: torch.Tensor, **kwargs):  # noqa: ANN202
        ranks = out.numel() // inp.numel()
        out.view(ranks, *inp.shape).copy_(inp.unsqueeze(0).expand(ranks, *inp.shape))
        return gather(out, inp, **kwargs)

    def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, **kwargs):  # noqa: ANN202
        out.copy_(inp[: out.shape[0]])
        return scatter(out, inp, **kwargs)

    comm._ALL_GATHER, comm._REDUCE_SCATTER = all_gather, reduce_scatter
    exchange = comm.exchange

    def exchange_filled(sends: list, recvs: list, group, wait: bool = True):  # noqa: ANN001, ANN202
        # the ring of context parallelism receives what it sends, shape for shape: this rank's
        # own block stands in for its neighbour's (as many bytes copied as would arrive)
        for index, (received, _) in enumerate(recvs):
            sent = sends[index][0] if index < len(sends) else None
            if sent is not None and sent.shape == received.shape:
                received.copy_(sent)
            else:
                received.zero_()
        return exchange(sends, recvs, group, wait)

    comm.exchange = exchange_filled
    fill_the_functional_collectives()


@torch.library.custom_op("mega_fake_rank::stand_in", mutates_args=())
def stand_in(result: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in place of ``result``, a fake collective's output (never written): one copy, as
    many bytes as the real collective writes. ``result`` is an input, so a compiled graph keeps
    the collective (its launch is part of a rank's host time). An opaque op, not a ``copy_`` into
    ``result``: compiled on a GPU, that copy was lost and the gathered and reduce-scattered
    gradients were the collective's unwritten buffer (zeros; 2026-12-01)."""
    return value.clone()


@stand_in.register_fake
def _(result: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


stand_in.register_autograd(
    lambda ctx, grad: (None, grad), setup_context=lambda ctx, inputs, output: None
)


def fill_the_functional_collectives() -> None:
    """The same stand-ins for the out-of-place collectives (:func:`stand_in`)."""
    from mega.parallel import functional_comm
    from mega.parallel.comm import group_size
    from mega.parallel.expert import collectives, padded_exchange
    from mega.parallel.tensor import overlapped

    gather, scatter = functional_comm._ALL_GATHER, functional_comm._REDUCE_SCATTER
    start, to_all = functional_comm.start_all_gather, functional_comm.all_to_all_rows
    start_equal = functional_comm.start_exchange

    def stacked(x: torch.Tensor, ranks: int) -> torch.Tensor:
        return x.unsqueeze(0).expand(ranks, *x.shape).reshape(ranks * x.shape[0], *x.shape[1:])

    def all_gather(x: torch.Tensor, dim: int, group):  # noqa: ANN001, ANN202
        out = functional_comm._waited(gather(x, dim, group))
        return stand_in(out, stacked(x, group_size(group)))

    def reduce_scatter(x: torch.Tensor, op: str, dim: int, group):  # noqa: ANN001, ANN202
        out = functional_comm._waited(scatter(x, op, dim, group))
        return stand_in(out, x[: out.shape[0]])

    def start_all_gather(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
        # waited here (nothing is in flight on the fake group); the caller's wait on the
        # stand-in is a no-op
        return stand_in(functional_comm.wait(start(x, size, name)), stacked(x, size))

    def start_exchange(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
        # equal blocks (the pipelined flex schedule's rows and counts): this rank's own
        return stand_in(functional_comm.wait(start_equal(x, size, name)), x)

    def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group):  # noqa: ANN001, ANN202
        out = to_all(x, send, recv, group)
        if out.shape == x.shape:  # equal splits: this rank's rows stand in for every peer's
            return stand_in(out, x)
        rows = min(out.shape[0], x.shape[0])
        pad = x.new_zeros(out.shape[0] - rows, *x.shape[1:])
        return stand_in(out, torch.cat([x[:rows], pad]))

    functional_comm._ALL_GATHER, functional_comm._REDUCE_SCATTER = all_gather, reduce_scatter
    overlapped.start_all_gather = start_all_gather
    padded_exchange.start_exchange = start_exchange
    collectives.all_to_all_rows = all_to_all_rows


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "2"))
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    fill_like_the_collectives()
    from mega.cli import main as mega_main

    mega_main(sys.argv[1:])


if __name__ == "__main__":
    main()
