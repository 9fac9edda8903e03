"""One rank of tests/test_moe_compile.py's compiled all-to-all check (run by torchrun on gloo):
the counted ``alltoall`` dispatcher compiled around its two eager trips, against the same
dispatcher eager and against every expert on one process, over four routings that differ (other
rows per expert and rank, a dropped slot in one). Dynamo must compile the dispatch once: the
experts between the trips take a row count marked unbacked, so a new count is no new graph.
``MOE_DISPATCHER=flex-overlap``: the ``flex`` dispatcher with its trips overlapped, whose
overlapped part torch.compile calls eager (a graph break), no slot dropped (it is dropless).
``MOE_DISPATCHER=flex-padded`` (with ``MEGA_FLEX_TRANSPORT=padded``): flex's trips by
all-to-alls of fixed splits, traced into the graph (``copy-engine`` on GPUs: the same trips by
the copy engine, opaque ops in the graph).

``MOE_GPU=1`` (tests/test_gpu_moe_flex.py): the same on GPUs over NCCL, in bf16 with the grouped
GEMM, compiled by Inductor, at a model's sizes; compared by relative error, loosely (bf16 and
Inductor's fusions round differently), since what it looks for is a wrong result, not rounding:
on 2 H200 the padded transport's EP2 training gradients were 18% off one GPU's (2026-11-30)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from mega.parallel.distributed import finish_job, leave_job
from mega.parallel.expert.copy_engine_exchange import copy_engine_usable, peer_rows_usable
from mega.parallel.expert.dispatchers import AllToAllDispatcher, DeviceSplitDispatcher
from mega.parallel.expert.local import local_mixture
from mega.parallel.expert.validate import padded_trips
from mega.parallel.tensor import copy_engine_split
from mega.plugins.models.common.moe import GroupedExperts, Routing

GPU = os.environ.get("MOE_GPU") == "1"
TOKENS, HIDDEN, FFN, EXPERTS, K = (2048, 512, 1024, 8, 2) if GPU else (24, 8, 16, 4, 2)
DISPATCHER = os.environ.get("MOE_DISPATCHER", "alltoall")
DEVICE = (
    torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if GPU else torch.device("cpu")
)
DTYPE = torch.bfloat16 if GPU else torch.float32


def experts_module(first: int, count: int) -> GroupedExperts:
    """Experts ``first .. first + count - 1`` of one seeded set of ``EXPERTS`` (the CPU's loop)."""
    cfg = SimpleNamespace(
        resolved_moe_ffn_hidden_size=lambda: FFN, swiglu=True, openai_gelu=False,
        num_experts=EXPERTS, hidden_size=HIDDEN, moe_grouped_gemm=GPU,
    )  # fmt: skip
    module = GroupedExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    for linear in (module.linear_fc1, module.linear_fc2):
        full = torch.randn(linear.weight.shape, generator=gen) * 0.3
        linear.weight.data = full[first : first + count].clone().to(DEVICE, DTYPE)
    module.first = first
    return module


def routing(call: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * call + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    probs, indices = torch.topk(torch.softmax(torch.randn(TOKENS, EXPERTS, generator=gen), -1), K)
    if call == 2 and DISPATCHER == "alltoall":  # a slot the capacity dropped: -1, weight 0
        indices[3, 1], probs[3, 1] = -1, 0.0
    return x.to(DEVICE, DTYPE), probs.to(DEVICE, DTYPE), indices.to(DEVICE)


def run(fn, x, probs, indices):  # noqa: ANN001, ANN201
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out = fn(x, probs, indices)
    out.backward(
        torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    )
    return [out.detach(), x.grad, probs.grad]


def assert_near(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Exact to ``tol`` on CPU (float32); on GPUs a relative error of the whole tensor: bf16's
    step is 2**-8, so a few of them (5e-2) pass rounding and fail a wrong row or gradient."""
    if not GPU:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        return
    error = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))
    assert error <= 5e-2, error


def main() -> None:
    dist.init_process_group("nccl" if GPU else "gloo")
    if GPU:
        torch.cuda.set_device(DEVICE)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    local = EXPERTS // ranks
    mine, everyone = experts_module(rank * local, local), experts_module(0, EXPERTS)
    if DISPATCHER == "alltoall":
        dispatcher = AllToAllDispatcher(dist.group.WORLD)
    else:  # flex, flex-overlap, or flex-padded (with MEGA_FLEX_TRANSPORT=padded)
        overlap = DISPATCHER == "flex-overlap"
        # MOE_PIPELINED=1: the pipelined schedule on CPU ranks too (eager and aot_eager only: see
        # flex_schedule.pipelined); on GPUs the grouped GEMM picks it
        pipelined = True if os.environ.get("MOE_PIPELINED") == "1" else None
        dispatcher = DeviceSplitDispatcher(dist.group.WORLD, overlap, pipelined)

    def dispatch(x, probs, indices):  # noqa: ANN001, ANN202
        return dispatcher(x, Routing(probs, indices, TOKENS, False), mine)

    def one_process(x, probs, indices):  # noqa: ANN001, ANN202
        return local_mixture(x, probs, indices, everyone, 0, EXPERTS)

    counter = CompileCounterWithBackend("inductor" if GPU else "aot_eager")
    compiled = torch.compile(dispatch, backend=counter)
    options = {}
    if GPU and DISPATCHER == "flex-overlap":  # as --compile compiles its layer (compile_options)
        options = dispatcher.compile_options
    frames = []
    for call in range(4):
        inputs = routing(call, rank)
        with torch._inductor.config.patch(options):
            eager, traced, whole = (run(f, *inputs) for f in (dispatch, compiled, one_process))
        for got, want in zip(traced, eager, strict=True):
            assert_near(got, want, 1e-6)
        for got, want in zip(eager, whole, strict=True):
            assert_near(got, want, 1e-5)
        # frames compiled, graphs or not (a frame without ops, recompiled, counts here only)
        frames.append((counter.frame_count, counters["frames"]["total"]))
    assert frames == frames[:1] * 4, frames  # compiled once, whatever the routing
    transport = os.environ.get("MEGA_FLEX_TRANSPORT")
    if GPU and transport in ("copy-engine", "peer-rows"):  # not the fallback
        usable = {"copy-engine": copy_engine_usable, "peer-rows": peer_rows_usable}[transport]
        assert usable(dist.group.WORLD, torch.zeros(1, device=DEVICE))
        assert any(key[1] == "flex" for key in copy_engine_split._INBOXES), "no such trip ran"
        assert counter.frame_count == 1, frames  # the trips opaque ops in one graph
        print(f"rank {rank}: symmetric memory carried the compiled layer's trips", flush=True)
    if DISPATCHER == "flex-overlap" and padded_trips() and GPU:  # pipelined: traced whole
        assert counter.frame_count == 1, frames
        print(f"rank {rank}: the pipelined dispatch is one graph", flush=True)
    print(f"rank {rank}: compiled {DISPATCHER} matches eager and one process, frames {frames}")
    finish_job()  # NVSHMEM's buffers (flex on GPUs) freed on every rank at once
    leave_job()  # the group destroyed and collected: gloo's threads joined, not torn down at exit


if __name__ == "__main__":
    main()
