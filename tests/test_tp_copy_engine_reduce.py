"""Tensor parallelism's all-reduces by the copy engine, without sequence parallelism
(``MEGA_TP_SPLIT_OVERLAP=copy-engine``, ``mega.parallel.tensor.copy_engine_reduce``), on gloo
ranks with the transport emulated (tests/test_tp_split_overlap.py's emulation: the algebra, not
the signals, which tests/test_gpu_copy_engine_split.py checks on GPUs): the column- and
row-parallel layers' outputs and gradients equal the NCCL-path layers', eager and compiled, and
a tensor-parallel GPT that takes the path equals one process."""

from __future__ import annotations

import pytest
import torch
from test_tp_split_overlap import _emulate_copy_engine, _fuse, _join, forward_backward

from mega.parallel.tensor import copy_engine_reduce
from mega.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from mega.testing.ranks import run_ranks

BATCH, TOKENS, IN, OUT = 2, 7, 24, 18  # 14 rows: uneven row chunks at 3 ranks' sums


def _layer(kind: str, rank: int, world: int, by_copy_engine: bool, fused: bool):  # noqa: ANN202
    import torch.distributed as dist

    torch.manual_seed(0)
    full = torch.nn.Linear(IN, OUT)
    if kind == "column":
        layer = ColumnParallelLinear.from_linear(full, dist.group.WORLD, rank, world)
    else:
        layer = RowParallelLinear.from_linear(full, dist.group.WORLD, rank, world)
    layer.reduce_by_copy_engine = by_copy_engine
    if fused:
        _fuse(layer.weight)
    return layer


def _run_rank(rank: int, world: int, kind: str, fused: bool, compiled: bool) -> dict:
    _join()
    on = [False]
    _emulate_copy_engine(pytest.MonkeyPatch(), on)
    # column: every token, replicated (the same on every rank); row: this rank's input columns
    torch.manual_seed(1 if kind == "column" else 1 + rank)
    shape = (BATCH, TOKENS, IN) if kind == "column" else (BATCH, TOKENS, IN // world)
    x = torch.randn(shape)
    out = {}
    for by_copy_engine in (True, False):
        on[0] = by_copy_engine
        layer = _layer(kind, rank, world, by_copy_engine, fused)
        out[by_copy_engine] = forward_backward(layer, x, compiled and by_copy_engine, fused)
    return out


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize(("world", "fused", "compiled"), [(2, False, False), (3, True, False), (2, True, True)])  # fmt: skip
def test_copy_engine_all_reduces_equal_nccls(kind: str, world: int, fused: bool, compiled: bool):
    """The row forward's and the column backward's sums, chunk by chunk: the NCCL path's
    outputs and gradients; eager at two ranks, the same bits (one addition of the same two
    values; compiled, inductor sums the bias gradient in its own order)."""
    for result in run_ranks(_run_rank, world, kind, fused, compiled):
        for got, want in zip(result[True], result[False], strict=True):
            if world == 2 and not compiled:
                assert torch.equal(got, want)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_chunks_cover_every_row_once():
    for rows in (1, 2, 7, 8192):
        chunks = copy_engine_reduce._chunks(rows)
        assert len(chunks) == min(copy_engine_reduce.CHUNKS, rows)
        assert [r for c in chunks for r in range(rows)[c]] == list(range(rows))


def _reduce_gpt_rank(rank: int, world_size: int, tp: int, cases: list) -> dict:
    """test_tensor_parallel's equivalence rank with the copy engine asked for (emulated),
    counting each copy-engine all-reduce."""
    import os

    from test_tensor_parallel import _equivalence_rank

    from mega.parallel.tensor import split_choice

    os.environ[split_choice.SPLIT_ENV] = split_choice.COPY_ENGINE  # read when layers are built
    _emulate_copy_engine(pytest.MonkeyPatch(), [True])
    calls = {"row-reduce": 0, "column-reduce": 0}
    send_chunk = copy_engine_reduce._send_chunk

    def counted(group, direction, chunk):  # noqa: ANN001, ANN202
        calls[direction.rsplit("-", 1)[0]] += 1
        return send_chunk(group, direction, chunk)

    copy_engine_reduce._send_chunk = counted
    return {"results": _equivalence_rank(rank, world_size, tp, cases), "calls": calls}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_parallel_gpt_with_copy_engine_all_reduces_equals_one_process(tp: int):
    """Every row-parallel forward and column-parallel backward of the GPT's attention and MLP
    takes the copy engine's all-reduce, and the loss (the same on every rank) and gradients
    equal the single process's (test_tensor_parallel's check)."""
    from test_tensor_parallel import check_equivalence

    cases = [("default", False, False)]
    ranks = run_ranks(_reduce_gpt_rank, tp, tp, cases)
    check_equivalence([r["results"] for r in ranks], cases, tp)
    sums = 2 * 2 * copy_engine_reduce.CHUNKS  # tiny(): 2 layers, 2 row- and 2 column-parallel each
    for r in ranks:
        assert r["calls"] == {"row-reduce": sums, "column-reduce": sums}, r
