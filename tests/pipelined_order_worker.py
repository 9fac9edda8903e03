"""The flex dispatcher's pipelined trips as inductor compiles them, on two gloo ranks with a GPU's
layer (the grouped GEMM in bf16, which torch also runs on the CPU: ``GROUPED_GEMM_DEVICES`` and
``GROUPED_DEVICES`` widened for this process) and the layer's compile options: in the generated
forward and in the backward some expert GEMM runs between a trip's start and its wait (the
overlap), and the outputs and gradients are eager's to bf16's rounding. Prints one line per rank.
Run by tests/test_moe_compile.py."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

from mega.parallel.distributed import leave_job
from mega.parallel.expert import local as expert_local
from mega.parallel.expert.dispatchers import DeviceSplitDispatcher
from mega.plugins.models.common import moe
from mega.plugins.models.common.moe import GroupedExperts, Routing

TOKENS, HIDDEN, FFN, EXPERTS, K = 64, 32, 64, 4, 2
EVENT = re.compile(
    r"(\w+) = torch\.ops\._c10d_functional\.all_to_all_single|wait_tensor\.default\((\w+)\)|_grouped_mm\("
)


def overlapped_trips(code: str) -> int:
    """How many all-to-alls of the generated code have a grouped GEMM between start and wait."""
    started, overlapped = {}, 0
    for match in EVENT.finditer(code):
        start, wait = match.groups()
        if start:
            started[start] = False
        elif wait:
            overlapped += started.pop(wait, False)
        else:  # a grouped GEMM: beside every trip in flight
            started = dict.fromkeys(started, True)
    return overlapped


def main() -> None:
    moe.GROUPED_GEMM_DEVICES = ("cuda", "meta", "cpu")
    expert_local.GROUPED_DEVICES = ("cuda", "cpu")
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = SimpleNamespace(
        resolved_moe_ffn_hidden_size=lambda: FFN, swiglu=True, openai_gelu=False,
        num_experts=EXPERTS, hidden_size=HIDDEN, moe_grouped_gemm=True,
    )  # fmt: skip
    experts = GroupedExperts(cfg)
    local = EXPERTS // n
    gen = torch.Generator().manual_seed(0)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        full = torch.randn(linear.weight.shape, generator=gen) * 0.3
        linear.weight.data = full[rank * local : (rank + 1) * local].clone().bfloat16()
    experts.first = rank * local
    dispatcher = DeviceSplitDispatcher(dist.group.WORLD, overlap=True)

    def layer(x, probs, indices):  # noqa: ANN001, ANN202
        return dispatcher(x, Routing(probs, indices, TOKENS, False), experts)

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    probs, indices = torch.topk(torch.softmax(torch.randn(TOKENS, EXPERTS, generator=gen), -1), K)
    compiled = torch.compile(layer, options=dispatcher.compile_options)
    results = []
    for fn in (layer, compiled):
        xx, pp = x.clone().requires_grad_(), probs.bfloat16().requires_grad_()

        def step(fn=fn, xx=xx, pp=pp):  # noqa: ANN001, ANN202
            out = fn(xx, pp, indices)
            (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            return out

        out, codes = run_and_get_code(step) if fn is compiled else (step(), [])
        results.append((out.float(), xx.grad.float(), pp.grad.float()))
    forward, backward = codes[0], codes[-1]
    assert len(codes) == 2, len(codes)  # one graph: its forward and its backward
    assert overlapped_trips(forward) >= 2 and overlapped_trips(backward) >= 2, (
        overlapped_trips(forward), overlapped_trips(backward),
    )  # fmt: skip
    for want, got in zip(*results, strict=True):
        error = (got - want).abs().max() / want.abs().max()
        assert error <= 2 * 2**-8, error.item()  # a rounding of bf16 (the in-order layer's too)
    print(f"rank {rank}: pipelined trips overlap the expert GEMMs, forward and backward")
    leave_job()


if __name__ == "__main__":
    os.environ.setdefault("MEGA_FLEX_TRANSPORT", "padded")
    main()
