"""Run ``mega`` as rank 0 of a larger job on this one GPU, over torch's fake process group:
every collective returns at once, so a layout's step time is one rank's compute alone (its
kernels and launches, no communication). What a multi-GPU layout costs beside its collectives,
measured on one GPU (``parallel_layouts.py --fake-world``).

    WORLD_SIZE=2 python benchmarks/fake_rank.py train ... --nproc-per-node 2 \
        --tensor-model-parallel-size 2 --sequence-parallel

The fake group writes nothing into a gather's or reduce-scatter's output, which would leave
uninitialised memory (NaNs now and then) in the activations: each rank's slice of the output is
this rank's input instead, one copy, as many bytes as the real collective writes.
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
