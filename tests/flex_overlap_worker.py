"""One rank of the overlapped ``flex`` schedule against the in-order one on 2 GPUs (run by
torchrun from tests/test_gpu_moe_flex.py): one MoE dispatch of the same tokens, routing and
experts both ways, outputs and gradients compared. To make a missing wait show, the GPU is kept
busy where a race would read early: every trip (forward and backward) and every expert call
(forward and backward) first sleeps on its stream, so a stream that did not wait for them reads
unfinished data. ``FLEX_SLEEP_CYCLES=0`` runs without the sleeps. Prints one line when all holds.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from mega.parallel.distributed import finish_job, leave_job
from mega.parallel.expert import flex_schedule, padded_exchange, split_exchange
from mega.parallel.expert.dispatchers import DeviceSplitDispatcher

TOKENS, HIDDEN, LOCAL, TOPK = 512, 64, 2, 2
CYCLES = int(os.environ.get("FLEX_SLEEP_CYCLES", "20000000"))  # ~10 ms on an H200


def _sleep() -> None:
    if CYCLES:
        torch.cuda._sleep(CYCLES)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first keeps its stream busy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _sleep()
        return grad


class Experts(torch.nn.Module):
    """``LOCAL`` experts, one matrix each, run on their rows one after another."""

    grouped_gemm = False

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.count = LOCAL
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        _sleep()
        x = _SlowBackward.apply(x)
        pieces = x.split(counts.tolist())
        return torch.cat([p @ self.weight[e] for e, p in enumerate(pieces)])


def _slowed(fn):  # noqa: ANN001, ANN202
    def slow(*args):  # noqa: ANN002, ANN202
        _sleep()
        return fn(*args)

    return slow


def run(overlap: bool, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=gen).cuda().requires_grad_(True)
    probs = torch.rand(TOKENS, TOPK, generator=gen).softmax(-1).cuda()
    indices = torch.randint(0, 2 * LOCAL, (TOKENS, TOPK), generator=gen).cuda()
    weight = torch.randn(LOCAL, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(9 + rank))
    experts = Experts(weight.cuda() / HIDDEN**0.5)
    routing = SimpleNamespace(probs=probs, indices=indices)
    out = DeviceSplitDispatcher(dist.group.WORLD, overlap=overlap)(tokens, routing, experts)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).cuda()
    (out * grad).sum().backward()
    torch.cuda.synchronize()
    return out.detach(), tokens.grad, experts.weight.grad


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    want = run(False, rank)
    # every trip (forward and backward) and every chunk's experts slowed from here on
    split_exchange._dispatch = _slowed(split_exchange._dispatch)
    split_exchange._combine = _slowed(split_exchange._combine)
    # MEGA_FLEX_TRANSPORT=padded: its all-to-alls (rows and counts) slowed the same way
    padded_exchange.exchange_rows = _slowed(padded_exchange.exchange_rows)
    got = run(True, rank)
    for name, a, b in zip(("output", "token grad", "weight grad"), want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"{name} differs")
    assert flex_schedule._SIDE, "the overlapped schedule never used its side stream"
    print(f"rank {rank}: overlapped flex equals in-order flex", flush=True)
    finish_job()  # the symmetric buffers freed on every rank at once (a collective free)
    leave_job()  # the group destroyed and collected: gloo's threads joined, not torn down at exit


if __name__ == "__main__":
    main()
