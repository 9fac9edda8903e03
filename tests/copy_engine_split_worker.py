"""One rank of tests/test_gpu_copy_engine_split.py (run under torchrun, one GPU per rank, NCCL):
the copy-engine split's passes (column forward and backward, row forward, row backward's gather;
mega.parallel.tensor.copy_engine_split) and the all-reduces without sequence parallelism (row
forward, column backward; mega.parallel.tensor.copy_engine_reduce) against the NCCL bodies on the
same inputs,
eager over three calls, then captured once in a CUDA graph and replayed with three new inputs
(the signals must end each pass where they began). Prints one line per rank when they agree."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mega.parallel.tensor import copy_engine_reduce, copy_engine_split, overlapped, split_overlap

ROWS, IN, OUT = 256, 128, 96  # a rank's token block, features, outputs


def _inputs(step: int, rank: int, size: int, device: torch.device) -> tuple:
    """This rank's column block, row-parallel input (every token) and dY block for ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    column = torch.randn(ROWS, IN, generator=gen)
    row = torch.randn(ROWS * size, IN, generator=gen)
    grad = torch.randn(ROWS, OUT, generator=gen)
    column_grad = torch.randn(ROWS * size, OUT, generator=gen)  # dY of the column layer
    return tuple(t.to(device, torch.bfloat16) for t in (column, row, grad, column_grad))


def _wgrad(grad_2d: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return grad_2d.t().mm(inputs)


def _copy_engine(inputs: tuple, w: torch.Tensor, b: torch.Tensor, group) -> list:  # noqa: ANN001
    column, row, grad, column_grad = inputs
    out = copy_engine_split.column_forward(column, w, b, group, split_overlap._rows)
    reduced = copy_engine_split.row_forward(row, w, group)
    grad_x, gathered = copy_engine_split.row_backward_gather(grad, row, w, group)
    column_dx, column_dw = copy_engine_split.column_backward(column_grad, column, w, group, _wgrad)
    return [out, reduced, grad_x, gathered, column_dx, column_dw, *_without_sp(inputs, w, group)]


def _without_sp(inputs: tuple, w: torch.Tensor, group) -> list:  # noqa: ANN001
    """The row forward's all-reduce and the column backward's (every token on every rank): by
    the copy engine or NCCL as the environment says (the bodies' own choice)."""
    _, row, _, column_grad = inputs
    name, size = group.group_name, dist.get_world_size(group)
    reduced = copy_engine_reduce._row_forward_body(row, w, name)
    dx, dw = overlapped._column_parallel_backward_body(
        column_grad, row, w, name, size, False, False
    )
    return [reduced, dx, dw]


def _nccl(inputs: tuple, w: torch.Tensor, b: torch.Tensor, group, size: int) -> list:  # noqa: ANN001
    column, row, grad, column_grad = inputs
    name = group.group_name
    os.environ[split_overlap.SPLIT_ENV] = "1"  # the bodies' NCCL branch
    try:
        out = split_overlap._column_forward_body(column, w, b, name, size)
        reduced = split_overlap._row_forward_body(row, w, name, size)
        column_dx, column_dw = overlapped._column_parallel_backward_body(
            column_grad, column, w, name, size, True, False
        )
        grad_x, gathered = split_overlap._row_backward_gather(grad, row, w, group, size)
        without_sp = _without_sp(inputs, w, group)
    finally:
        os.environ[split_overlap.SPLIT_ENV] = "copy-engine"
    return [out, reduced, grad_x, gathered, column_dx, column_dw, *without_sp]


# sums over the ranks: other orders than NCCL's beyond 2
SUMMED = (
    "row",
    "column-backward dX",
    "row all-reduce",
    "column all-reduce dX",
)  # sums over the ranks: other orders than NCCL's beyond 2


def _agree(got: list, want: list, what: str, size: int) -> None:
    # the same products of the same bf16 operands (the GEMMs may tile the blocks differently:
    # 1e-2); beyond two ranks the sums add in another order than NCCL's, each addition rounded
    # to bf16 (8 bits): up to size - 1 half-ulps of sums of magnitude ~8 (0.03 seen in a CPU
    # simulation of these shapes at 4 ranks)
    names = ("column", "row", "row-backward dX", "gathered dY", "column-backward dX", "dW")
    names += ("row all-reduce", "column all-reduce dX", "column all-reduce dW")
    for name, g, w in zip(names, got, want, strict=True):
        bound = 5e-2 if name in SUMMED and size > 2 else 1e-2
        torch.testing.assert_close(g, w, rtol=bound, atol=bound, msg=f"{what}: {name}")


def main() -> None:
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    torch.manual_seed(0)
    w = torch.randn(OUT, IN, device=device, dtype=torch.bfloat16) / IN**0.5
    b = torch.randn(OUT, device=device, dtype=torch.bfloat16)
    for step in range(3):
        inputs = _inputs(step, rank, size, device)
        want = _nccl(inputs, w, b, group, size)
        _agree(_copy_engine(inputs, w, b, group), want, f"eager {step}", size)
    static = [t.clone() for t in _inputs(0, rank, size, device)]
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _copy_engine(static, w, b, group)
    for step in range(3, 6):
        inputs = _inputs(step, rank, size, device)
        for s, t in zip(static, inputs, strict=True):
            s.copy_(t)
        graph.replay()
        _agree(captured, _nccl(inputs, w, b, group, size), f"replay {step}", size)
    torch.cuda.synchronize()
    print(f"rank {rank}: copy-engine and nccl splits agree", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
