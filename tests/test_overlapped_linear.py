"""The column-parallel linear's overlapped backward (``--tp-comm-overlap``,
``mega.parallel.tensor.overlapped``) on 2 gloo ranks: its gradients (plain and fused into ``main_grad``) equal the mappings-built layer's,
eager and compiled, and under sequence parallelism it keeps only the token block from forward
to backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mega.parallel.tensor.linear import ColumnParallelLinear
from mega.parallel.tensor.mappings import copy_to_tensor_parallel, gather_from_sequence
from mega.parallel.weight_grad import register_fused_weight
from mega.testing.ranks import run_ranks

TOKENS, IN, OUT = 8, 16, 24


def _join() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # the launcher's env:// variables


def _layer(rank: int, sp: bool, fused: bool) -> ColumnParallelLinear:
    _join()
    torch.manual_seed(0)
    full = torch.nn.Linear(IN, OUT)
    layer = ColumnParallelLinear.from_linear(
        full, dist.group.WORLD, rank, 2, sequence_parallel=sp, comm_overlap=True
    )
    assert layer.group_name is not None  # the overlapped path, not a group of one
    if fused:
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        layer.weight.main_grad_fresh = True
        layer.weight.fuse_wgrad = True
        register_fused_weight(layer.weight)
    return layer


def _reference(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer as the mappings build it: collective, then the GEMM (autograd's backward)."""
    group = layer.group
    gathered = gather_from_sequence(x, group) if layer.sequence_parallel else None
    full = gathered if gathered is not None else copy_to_tensor_parallel(x, group)
    return torch.nn.functional.linear(full, layer.weight, layer.bias)


def _gradients_rank(rank: int, world: int, sp: bool, fused: bool, compiled: bool) -> dict:
    _join()
    torch.manual_seed(1 + rank)  # each rank its own token block (sp) or the same input (tp)
    x = torch.randn(2, TOKENS // (2 if sp else 1), IN)
    if not sp:
        dist.broadcast(x, 0)
    out = {}
    for name in ("overlapped", "reference"):
        layer = _layer(rank, sp, fused and name == "overlapped")
        xi = x.clone().requires_grad_(True)
        run = layer if name == "overlapped" else (lambda t, m=layer: _reference(m, t))
        if compiled and name == "overlapped":
            run = torch.compile(layer)
        y = run(xi)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        weight_grad = (
            layer.weight.main_grad if fused and name == "overlapped" else layer.weight.grad
        )
        out[name] = (y.detach(), xi.grad.clone(), weight_grad.clone(), layer.bias.grad.clone())
    return out


@pytest.mark.parametrize(
    "sp,fused,compiled",
    [(False, False, False), (True, False, False), (True, True, False), (True, False, True),
     (False, True, True)],
)  # fmt: skip
def test_overlapped_gradients_equal_the_mappings_layer(sp: bool, fused: bool, compiled: bool):
    for result in run_ranks(_gradients_rank, 2, sp, fused, compiled):
        for got, want in zip(result["overlapped"], result["reference"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _saved_rank(rank: int, world: int) -> list[list[tuple[int, ...]]]:
    """The shapes of what each layer's GEMM node keeps for backward: overlapped, then built from
    the mappings."""
    layer = _layer(rank, True, False)
    x = torch.randn(2, TOKENS // 2, IN, requires_grad=True)
    shapes = []
    for y in (layer(x), _reference(layer, x)):
        node = y.grad_fn
        while not node.name().startswith(
            ("_ColumnParallelLinear", "AddmmBackward", "ViewBackward")
        ):
            node = node.next_functions[0][0]
        if node.name().startswith("ViewBackward"):  # linear on [b, s, in]: view, addmm, view
            node = node.next_functions[0][0]
        saved = getattr(node, "saved_tensors", None) or (node._saved_mat1,)
        shapes.append([tuple(t.shape) for t in saved])
    return shapes


def test_sequence_parallel_keeps_the_token_block_not_the_gathered_input():
    for overlapped, reference in run_ranks(_saved_rank, 2):
        assert (2, TOKENS // 2, IN) in overlapped and (2, TOKENS, IN) not in overlapped
        # the check can fail: the mappings-built layer keeps the gathered tokens
        assert (TOKENS * 2, IN) in reference, reference
