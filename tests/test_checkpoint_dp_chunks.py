"""Distributed-optimizer ranges end anywhere in a tensor, so at DP2 two ranks (and two pieces of
one rank: a partial row, then whole rows) wrote parts of one zarr chunk; tensorstore then reads,
merges and rewrites the chunk, and the two ranks' conditional writes collide: on 2 H100s the DP2
save of a 1.3B GPT took twice as long as the TP2 one. Now a save gathers each such chunk at one
rank (``mega.core.checkpoint.shared_chunks``): every chunk file is written by one rank, in one
box that covers it, and every value is written once."""

from __future__ import annotations

import dataclasses
import json
from itertools import product
from math import prod
from pathlib import Path

import pytest
import torch

from mega.core.checkpoint.shared_chunks import cell_box, cells, chunk_grid, describe, plan
from mega.testing.ranks import run_ranks

from conftest import TINY

ARGS = [
    *TINY, "--bf16", "--use-distributed-optimizer", "--mock-data", "--train-iters", "1",
    "--device", "cpu",
]  # fmt: skip


def _save_and_load(rank: int, world_size: int, directory: str, flags: list[str]) -> dict:
    import torch.distributed as dist

    from mega.core.checkpoint import api
    from mega.core.checkpoint.sharded_store import start_sharded_save
    from mega.core.config.resolve import resolve_config
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine
    from mega.core.training.run_state import sharded_tensors

    plugins = make_plugins()
    config = resolve_config([*ARGS, *flags, "--run-dir", f"{directory}/run{rank}"], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()  # real optimizer state
    tensors = sharded_tensors(engine)
    written = [t for t in tensors if t.write and t.pieces]
    described: list = [None] * world_size
    dist.all_gather_object(described, describe(written))
    zarr = plugins.checkpoint_backends.get("zarr")
    boxes = []

    def write(path, ts):
        boxes.extend((t.key, tuple(p.start), tuple(p.data.shape)) for t in ts for p in t.pieces)
        return zarr.write(path, ts)

    final = Path(directory) / "ckpt"
    backend = dataclasses.replace(zarr, write=write)
    start_sharded_save(final, 1, tensors, {}, {}, backend).finish()
    saved = [p.data.clone() for t in tensors for p in t.pieces]
    with torch.no_grad():
        for t in tensors:
            for p in t.pieces:
                p.data.fill_(7.0)
    api.load({t.key: t for t in tensors}, final)
    loaded = [p.data for t in tensors for p in t.pieces]
    return {
        "shared_before": len(plan(described)),
        "boxes": boxes,
        "round_trip": all(a.equal(b) for a, b in zip(saved, loaded, strict=True)),
    }


@pytest.mark.parametrize(
    "flags", [[], ["--ddp-bucket-size", "3000"]], ids=["one-bucket", "several-buckets"]
)
def test_dp2_every_chunk_is_written_by_one_rank_in_one_box(tmp_path: Path, flags: list[str]):
    results = run_ranks(_save_and_load, 2, str(tmp_path), flags, timeout=240)
    # the layout cuts chunks between ranks: without the gathering, they were written in parts
    assert results[0]["shared_before"] > 0
    assert all(r["round_trip"] for r in results)
    ckpt = tmp_path / "ckpt"
    arrays = json.loads((ckpt / "metadata.json").read_text())["tensors"]
    writers: dict[tuple, list] = {}
    for rank, result in enumerate(results):
        for key, start, shape in result["boxes"]:
            meta = json.loads((ckpt / key / "zarr.json").read_text())
            grid = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
            for cell in cells((start, shape), grid):
                whole = cell_box(cell, grid, tuple(meta["shape"]))
                covers = all(
                    s <= c and c + m <= s + n
                    for s, n, c, m in zip(start, shape, whole[0], whole[1], strict=True)
                )
                writers.setdefault((key, cell), []).append((rank, covers))
    for (key, cell), who in writers.items():
        assert len(who) == 1, f"{key} chunk {cell} written by {who}"
        assert who[0][1], f"{key} chunk {cell}: written in part"
    # every value written once: the written boxes add up to the arrays
    written = sum(prod(shape) for r in results for _, _, shape in r["boxes"])
    assert written == sum(prod(a["shape"]) for a in arrays.values())


def test_chunk_grid_cuts_the_first_dimension_to_a_divisor_under_64_mib():
    # the zarr backend creates its arrays with this grid (zarr_tensorstore.create)
    expected = {
        ((50175, 2048), None, 4): (5575, 2048),  # 50175 = 9 x 5575; 5575 x 8 KiB < 64 MiB
        ((8192, 2048), (4096, 2048), 4): (4096, 2048),  # 32 MiB: kept
        ((50304, 2048), (25152, 2048), 2): (12576, 2048),  # 48 MiB after one halving
        ((2048,), None, 4): (2048,),
        ((), None, 4): (),
        ((7, 1 << 24), None, 4): (1, 1 << 24),  # a row over the bound stays one row
    }
    for (shape, chunks, itemsize), grid in expected.items():
        assert chunk_grid(shape, chunks, itemsize) == grid, (shape, chunks)


def test_plan_gives_a_chunk_that_two_ranks_share_to_the_one_holding_most():
    # a [4, 3] tensor, one chunk, cut at flat offset 5: rank 0 rows 0 and 1[:2], rank 1 the rest
    pieces = {0: [((0, 0), (1, 3)), ((1, 0), (1, 2))], 1: [((1, 2), (1, 1)), ((2, 0), (2, 3))]}
    described = [{"a": ((4, 3), 4, (4, 3), pieces[r])} for r in (0, 1)]
    ((key, (grid, _, shared)),) = plan(described).items()
    assert key == "a" and grid == (4, 3)
    owner, whole, parts = shared[(0, 0)]
    assert owner == 1 and whole == ((0, 0), (4, 3))  # rank 1 holds 7 of the 12 values
    assert sorted((r, i) for r, i, _ in parts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # pieces that fill their own chunks share nothing
    alone = [{"b": ((4, 3), 4, (2, 3), [((2 * r, 0), (2, 3))])} for r in (0, 1)]
    assert plan(alone) == {}
    assert list(product(range(2), range(1))) == cells(((0, 0), (4, 3)), (2, 3))


def _two_pieces_in_one_chunk(device: str) -> list:
    # a [4, 3] float tensor of one chunk, written by this rank as two pieces (rows 0-1, 2-3)
    from mega.parallel.sharded import Piece, ShardedTensor

    full = torch.arange(12, dtype=torch.float32, device=device).view(4, 3)
    pieces = [Piece((0, 0), full[:2]), Piece((2, 0), full[2:])]
    return [ShardedTensor("a", (4, 3), torch.float32, pieces, chunks=(4, 3))]


def _consolidated(device: str, pinned: bool) -> torch.Tensor:
    from mega.core.checkpoint.shared_chunks import consolidate

    def exchange(ops: list) -> None:
        assert not ops  # one rank: nothing travels

    (tensor,) = consolidate(_two_pieces_in_one_chunk(device), 0, lambda v: [v], exchange,
                            pinned=pinned)  # fmt: skip
    (piece,) = tensor.pieces  # the chunk, whole, owned: a copy on the host
    assert piece.owned and piece.start == (0, 0) and piece.data.device.type == "cpu"
    assert torch.equal(piece.data, torch.arange(12, dtype=torch.float32).view(4, 3))
    return piece.data


@pytest.mark.parametrize("pinned", [False, True])
def test_a_chunk_of_two_pieces_is_written_whole_from_a_host_copy(pinned: bool):
    _consolidated("cpu", pinned)


@pytest.mark.gpu
def test_an_async_save_gathers_chunks_into_pinned_memory():
    # pageable copies made the DP2 async save's stall 3.8-5.0 s on 2 H100 (0.5-0.6 before the
    # chunks were gathered); pinned, the copies run while the next batch is exchanged
    assert _consolidated("cuda", pinned=True).is_pinned()
    assert not _consolidated("cuda", pinned=False).is_pinned()


def test_the_chunks_to_pin_before_the_first_async_save_are_the_ones_the_save_gathers():
    # prepare_pinned_copies pins these sizes at setup: they must be what consolidate owns
    from mega.core.checkpoint.shared_chunks import consolidate, owned_chunk_bytes

    tensors = _two_pieces_in_one_chunk("cpu")
    sizes = owned_chunk_bytes(tensors, 0, lambda v: [v])
    (tensor,) = consolidate(tensors, 0, lambda v: [v], lambda ops: None)
    owned = [p.data.numel() * p.data.element_size() for p in tensor.pieces if p.owned]
    assert sizes == owned == [48]
    # the other rank of a two-rank plan owns nothing of it
    assert owned_chunk_bytes(tensors, 1, lambda v: [v]) == []


def test_replicated_weights_are_spread_over_the_dp_ranks_by_bytes():
    # a GPT layer's 12 parameters, its four matrices at even positions: taking turns by index
    # gave DP rank 0 every matrix (10.5 GB of a 1.3B GPT's checkpoint against 7.9 on rank 1)
    from torch import nn

    from mega.parallel.sharded_state import replica_writers

    class Layer(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            for name, shape in [
                ("norm1_w", (h,)),
                ("norm1_b", (h,)),
                ("qkv_w", (3 * h, h)),
                ("qkv_b", (3 * h,)),
                ("proj_w", (h, h)),
                ("proj_b", (h,)),
                ("norm2_w", (h,)),
                ("norm2_b", (h,)),
                ("fc1_w", (4 * h, h)),
                ("fc1_b", (4 * h,)),
                ("fc2_w", (h, 4 * h)),
                ("fc2_b", (h,)),
            ]:
                self.register_parameter(name, nn.Parameter(torch.zeros(shape)))  # fmt: skip

    model = nn.Sequential(*(Layer(16) for _ in range(4)))
    expert = nn.Parameter(torch.zeros(64, 16))
    expert.expert_parallel = True
    model.register_parameter("expert_w", expert)
    for size in (2, 3):
        writers = replica_writers(model, size, expert=False)
        assert "expert_w" not in writers
        params = dict(model.named_parameters())
        load = [0] * size
        for name, rank in writers.items():
            load[rank] += params[name].numel() * 4
        largest = max(p.numel() * 4 for n, p in params.items() if n != "expert_w")
        # greedy by size: within one tensor (by index, rank 0 held every matrix)
        assert max(load) - min(load) <= largest
    assert replica_writers(model, 2, expert=True) == {"expert_w": 0}
