"""One rank of tests/test_gpu_ring_lanes.py (run by torchrun): ring attention forward and backward
with the copy-engine lanes and with NCCL send/recv, on the same inputs. The transport moves bytes
and the kernels run in the same order, so the results are equal up to the attention backward's own
run-to-run differences (its dq may be summed by atomics): bounded by bf16's rounding, 1% of the
largest value, where a block read before it arrived, or a slot overwritten while in use, is off
by the order of the values themselves. Several calls of three sizes in a row: the inboxes are
reused and grown, and their tokens must come back each time (a lost token hangs the next call)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mega.parallel.context.lanes import CopyEngineLane, lane
from mega.parallel.context.ring import ring_attention
from mega.parallel.context.transport_choice import TRANSPORT_ENV
from mega.parallel.distributed import leave_job


def attention(transport: str, seed: int, s_local: int) -> list[torch.Tensor]:
    os.environ[TRANSPORT_ENV] = transport
    rank, cp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    b, h, g, d = 2, 8, 4, 64

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        return x.requires_grad_()

    query = rand(b, s_local, h, d)
    k, v = rand(b, g, s_local, d), rand(b, g, s_local, d)
    q = query.transpose(1, 2)  # [b, h, s, d] views, as the model gives them
    group = dist.group.WORLD
    peers = ((rank + 1) % cp, (rank - 1) % cp)
    out = ring_attention(q, k, v, group, peers, rank, cp, d**-0.5)
    out.backward(torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype))
    return [out.detach(), query.grad, k.grad, v.grad]


def main() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    probe = torch.empty(1, device="cuda")
    os.environ[TRANSPORT_ENV] = "copy-engine"
    chosen = lane(dist.group.WORLD, 0, 0, "probe", probe)
    assert isinstance(chosen, CopyEngineLane), "the copy engine was not chosen on one host"
    worst = 0.0
    for seed, s_local in enumerate((256, 256, 1024, 512, 1024)):
        copied = attention("copy-engine", seed, s_local)
        sent = attention("nccl", seed, s_local)
        for name, a, b in zip(("out", "dq", "dk", "dv"), copied, sent, strict=True):
            diff = (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
            worst = max(worst, diff)
            assert diff <= 1e-2, (dist.get_rank(), seed, s_local, name, diff)
    torch.cuda.synchronize()
    print(f"rank {dist.get_rank()}: copy-engine and nccl agree, worst {worst:.2e}", flush=True)
    leave_job()  # the group destroyed and collected: gloo's threads joined, not torn down at exit


if __name__ == "__main__":
    main()
