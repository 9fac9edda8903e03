"""``MEGA_FLEX_TRANSPORT=copy-engine`` on CPU ranks: the op's wiring (its autograd, its fake for
the compiler, one graph when compiled) with the copy itself replaced by gloo's all-to-all, since
symmetric memory needs GPUs of one host (tests/test_gpu_moe_flex.py runs the real copies); the
choice falling back to the padded trips' all-to-all off GPUs; and the checks before launch."""

from __future__ import annotations

import pytest
import torch

from mega.testing.ranks import run_ranks

ROWS, HIDDEN = 6, 5  # rows per block


def _gloo_trip(x: torch.Tensor, group, real=None) -> torch.Tensor:  # noqa: ANN001
    """What ``_trip`` does by the copy engine, by gloo: block ``q`` to rank ``q`` (whole: the
    tests give ``peer_rows_exchange`` every row as real)."""
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _wiring(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from mega.parallel.expert import copy_engine_exchange as ce
    from mega.parallel.expert.collectives import exchange_rows

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    ce._trip = _gloo_trip  # the op's body, looked up when it runs
    rows = world_size * ROWS
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rank))
    weight = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(9))

    def through_op(t: torch.Tensor) -> torch.Tensor:
        return ce.copy_engine_exchange(t * 2.0, group.group_name) * weight

    every = torch.full((world_size,), ROWS)

    def through_rows(t: torch.Tensor) -> torch.Tensor:
        return ce.peer_rows_exchange(t * 2.0, every, every, group.group_name) * weight

    def through_c10d(t: torch.Tensor) -> torch.Tensor:
        return exchange_rows(t * 2.0, [ROWS] * world_size, [ROWS] * world_size, group) * weight

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(through_op, backend=counter, fullgraph=True)
    rows_counter = CompileCounterWithBackend("aot_eager")
    compiled_rows = torch.compile(through_rows, backend=rows_counter, fullgraph=True)
    results = []
    for f in (through_c10d, through_op, compiled, through_rows, compiled_rows):
        leaf = x.clone().requires_grad_(True)
        out = f(leaf)
        out.sum().backward()
        results.append((out.detach(), leaf.grad))
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)
    # one graph, the trip an opaque op in it (not its Python body, which would not trace)
    (graph,) = counter.graphs
    assert "copy_engine_exchange" in graph.code, graph.code
    (graph,) = rows_counter.graphs
    assert "peer_rows_exchange" in graph.code, graph.code
    dist.destroy_process_group()
    return [float(results[0][0].sum())]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_op_is_the_equal_blocks_all_to_all_with_its_gradient_and_compiles_whole(world_size):
    sums = run_ranks(_wiring, world_size)
    assert len(sums) == world_size


def test_the_fake_gives_the_shape_and_the_gradient_takes_the_same_trip():
    from mega.parallel.expert.copy_engine_exchange import copy_engine_exchange

    x = torch.empty(8, 3, device="meta", requires_grad=True)
    y = copy_engine_exchange(x, "no group: the fake runs")
    assert y.shape == x.shape and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_the_peer_rows_fake_gives_the_shape_and_its_gradient_swaps_the_counts():
    from mega.parallel.expert.copy_engine_exchange import peer_rows_exchange

    x = torch.empty(8, 3, device="meta", requires_grad=True)
    sent, arrived = torch.empty(2, dtype=torch.int64, device="meta"), torch.empty(2, device="meta")
    y = peer_rows_exchange(x, sent, arrived, "no group: the fake runs")
    assert y.shape == x.shape and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape


def _usable(rank: int, world_size: int) -> bool:
    import torch.distributed as dist

    from mega.parallel.expert.copy_engine_exchange import copy_engine_usable, peer_rows_usable

    dist.init_process_group("gloo")
    usable = copy_engine_usable(dist.group.WORLD, torch.zeros(1)) or peer_rows_usable(
        dist.group.WORLD, torch.zeros(1)
    )
    dist.destroy_process_group()
    return usable


@pytest.mark.parametrize("transport", ["copy-engine", "peer-rows"])
def test_cpu_ranks_asking_for_symmetric_memory_take_the_group_all_to_all(transport: str):
    assert run_ranks(_usable, 2, env={"MEGA_FLEX_TRANSPORT": transport}) == [False, False]
