"""Sequence parallelism's collectives split by token block (``MEGA_TP_SPLIT_OVERLAP=1``,
``mega.parallel.tensor.split_overlap``) on 2 and 3 gloo ranks: the column- and row-parallel
layers' outputs and gradients (plain and fused into ``main_grad``) equal the unsplit layers',
eager and compiled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mega.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from mega.parallel.weight_grad import register_fused_weight
from mega.testing.ranks import run_ranks

BATCH, TOKENS, IN, OUT = 2, 12, 24, 18  # tokens, features and outputs split over 2 and 3 ranks


def _join() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _fuse(weight: torch.nn.Parameter) -> None:
    weight.main_grad = torch.zeros_like(weight)
    weight.main_grad_fresh = True
    weight.fuse_wgrad = True
    register_fused_weight(weight)


def _layers(kind: str, rank: int, world: int, split: bool, fused: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    full = torch.nn.Linear(IN, OUT)
    if kind == "column":
        layer = ColumnParallelLinear.from_linear(
            full, dist.group.WORLD, rank, world, sequence_parallel=True, comm_overlap=True
        )
    else:
        layer = RowParallelLinear.from_linear(
            full, dist.group.WORLD, rank, world, sequence_parallel=True
        )
    layer.split_overlap = split
    if fused:
        _fuse(layer.weight)
    return layer


class _EmulatedInbox:
    """mega.parallel.tensor.copy_engine_split's inbox on CPU ranks: what a pass sends is held
    until its receive, then exchanged by gloo's all-to-all (the copy engine's algebra, not its
    transport: ordering and signals are tests/test_gpu_copy_engine_split.py's)."""

    def __init__(self, group) -> None:  # noqa: ANN001
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.handle = group, SimpleNamespace(rank=rank, world_size=size)
        self.peers = [(rank + k) % size for k in range(1, size)]
        self.blocks: dict = {}


def _emulated_send(inbox: _EmulatedInbox, blocks: dict) -> None:
    inbox.blocks = {q: block.clone() for q, block in blocks.items()}


def _emulated_receive(inbox: _EmulatedInbox, like: torch.Tensor, use) -> None:  # noqa: ANN001
    size = inbox.handle.world_size
    sent = torch.cat([inbox.blocks.get(q, torch.zeros_like(like)) for q in range(size)])
    arrived = torch.empty_like(sent)
    dist.all_to_all_single(arrived, sent, group=inbox.group)
    for q in reversed(inbox.peers):  # as copy_engine_split.receive
        use(q, arrived[q * like.shape[0] : (q + 1) * like.shape[0]].view_as(like))


def _emulate_copy_engine(monkeypatch: pytest.MonkeyPatch, on: list) -> None:
    """The copy-engine bodies on CPU ranks while ``on[0]`` (the split layers' turn)."""
    from mega.parallel.tensor import copy_engine_split, split_overlap

    monkeypatch.setattr(copy_engine_split, "inbox_for", lambda group, *_: _EmulatedInbox(group))
    monkeypatch.setattr(copy_engine_split, "send_blocks", _emulated_send)
    monkeypatch.setattr(copy_engine_split, "receive", _emulated_receive)
    monkeypatch.setattr(split_overlap, "by_copy_engine", lambda *_: on[0])


def _run_rank(
    rank: int, world: int, kind: str, fused: bool, compiled: bool, copy_engine: bool = False
) -> dict:
    _join()
    on = [False]
    if copy_engine:
        _emulate_copy_engine(pytest.MonkeyPatch(), on)
    torch.manual_seed(1 + rank)
    # column: this rank's token block of the input; row: every token, this rank's input columns
    shape = (BATCH, TOKENS // world, IN) if kind == "column" else (BATCH, TOKENS, IN // world)
    x = torch.randn(shape)
    out = {}
    for split in (True, False):
        on[0] = split
        layer = _layers(kind, rank, world, split, fused)
        out[split] = forward_backward(layer, x, compiled and split, fused)
    return out


def forward_backward(layer: torch.nn.Module, x: torch.Tensor, compiled: bool, fused: bool) -> tuple:
    """(output, dX, dW (``main_grad`` when fused), the bias gradient or None) of one step of
    ``layer`` on ``x`` under a loss that weighs every output element differently."""
    xi = x.clone().requires_grad_(True)
    y = (torch.compile(layer) if compiled else layer)(xi)
    (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
    grad_w = layer.weight.main_grad if fused else layer.weight.grad
    bias_grad = layer.bias.grad.clone() if layer.bias.grad is not None else None
    return y.detach(), xi.grad.clone(), grad_w.clone(), bias_grad


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize(
    ("world", "fused", "compiled"), [(2, False, False), (3, False, False), (3, True, False), (2, True, True)]
)  # fmt: skip
def test_split_layers_equal_the_unsplit_ones(kind: str, world: int, fused: bool, compiled: bool):
    for result in run_ranks(_run_rank, world, kind, fused, compiled):
        for got, want in zip(result[True], result[False], strict=True):
            if want is None:
                assert got is None
                continue
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize(("world", "fused", "compiled"), [(2, False, False), (3, True, False), (2, True, True)])  # fmt: skip
def test_copy_engine_bodies_equal_the_unsplit_layers(
    kind: str, world: int, fused: bool, compiled: bool
):
    """``copy-engine``'s column forward and backward, row forward and row backward's gather
    (their transport emulated by gloo) give the unsplit layers' outputs and gradients, eager
    and inside a compiled layer (the custom ops' shapes hold for the copy-engine bodies)."""
    for result in run_ranks(_run_rank, world, kind, fused, compiled, True):
        for got, want in zip(result[True], result[False], strict=True):
            if want is None:
                assert got is None
                continue
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_is_opt_in(monkeypatch):
    from mega.parallel.tensor.split_choice import SPLIT_ENV, split_chosen

    monkeypatch.delenv(SPLIT_ENV, raising=False)
    assert not split_chosen()
    monkeypatch.setenv(SPLIT_ENV, "1")
    assert split_chosen()
    monkeypatch.setenv(SPLIT_ENV, "copy-engine")
    assert split_chosen()


def test_the_moved_names_keep_their_old_path_with_a_warning():
    from mega.parallel.tensor import split_choice, split_overlap

    for name in ("split_chosen", "split_problem"):
        with pytest.warns(DeprecationWarning, match=f"split_choice import {name}"):
            assert getattr(split_overlap, name) is getattr(split_choice, name)


def test_copy_engine_falls_back_to_the_nccl_split_off_gpus(monkeypatch):
    """``copy-engine`` needs CUDA GPUs of one host; CPU tensors take the collectives' split."""
    from mega.parallel.tensor.split_overlap import SPLIT_ENV, by_copy_engine

    monkeypatch.setenv(SPLIT_ENV, "copy-engine")
    assert not by_copy_engine(None, torch.zeros(1))


def test_a_bad_value_is_one_error_line(monkeypatch):
    from mega.core.config.resolve import resolve_config
    from mega.errors import MegaUsageError
    from mega.testing import TINY_GPT
    from mega.testing.commands import make_test_plugins

    monkeypatch.setenv("MEGA_TP_SPLIT_OVERLAP", "yes")
    args = [*TINY_GPT, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    with pytest.raises(
        MegaUsageError, match="MEGA_TP_SPLIT_OVERLAP='yes': must be one of 0, 1, copy-engine"
    ):
        resolve_config([*args, "--nproc-per-node", "2"], make_test_plugins())


@pytest.mark.parametrize(
    ("value", "flags", "needs"),
    [
        ("1", [], "needs --tensor-model-parallel-size > 1 and --seq"),
        ("1", ["--tensor-model-parallel-size", "2"], "needs --tensor-model-parallel-size > 1 and --seq"),
        ("copy-engine", [], r"needs --tensor-model-parallel-size > 1\)"),
    ],
    ids=["split-no-tp", "split-tp-without-sp", "copy-engine-no-tp"],
)  # fmt: skip
def test_a_split_with_nothing_to_split_is_one_error_line(
    monkeypatch, value: str, flags: list, needs: str
):
    """``1`` splits sequence parallelism's collectives and ``copy-engine`` carries tensor
    parallelism's: asked for where the run has none, it would do nothing; refused before launch
    rather than silently ignored."""
    from mega.core.config.resolve import resolve_config
    from mega.errors import MegaUsageError
    from mega.testing import TINY_GPT
    from mega.testing.commands import make_test_plugins

    monkeypatch.setenv("MEGA_TP_SPLIT_OVERLAP", value)
    args = [*TINY_GPT, *flags, "--nproc-per-node", "2"]
    with pytest.raises(MegaUsageError, match=needs):
        resolve_config(args, make_test_plugins())
    monkeypatch.setenv("MEGA_TP_SPLIT_OVERLAP", "0")  # the default asks for nothing
    resolve_config(args, make_test_plugins())


def test_the_copy_engine_carries_tensor_parallelism_without_sp(monkeypatch):
    """``copy-engine`` with TP and no sequence parallelism: accepted (the all-reduces,
    ``mega.parallel.tensor.copy_engine_reduce``)."""
    from mega.core.config.resolve import resolve_config
    from mega.testing import TINY_GPT
    from mega.testing.commands import make_test_plugins

    monkeypatch.setenv("MEGA_TP_SPLIT_OVERLAP", "copy-engine")
    args = [*TINY_GPT, "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"]
    resolve_config(args, make_test_plugins())


def _split_gpt_rank(rank: int, world_size: int, tp: int, cases: list) -> dict:
    """test_tensor_parallel's equivalence rank with the split on, counting each split op."""
    import os

    from test_tensor_parallel import _equivalence_rank

    from mega.parallel.tensor import split_overlap

    os.environ[split_overlap.SPLIT_ENV] = "1"  # read when the layers are built
    calls = {"column": 0, "row": 0, "row_backward": 0}
    for name, op in (("column", "_column_forward"), ("row", "_row_forward"),
                     ("row_backward", "_row_backward")):  # fmt: skip
        opaque = getattr(split_overlap, op)

        def counted(*args, body=opaque.body, name=name):  # noqa: ANN001, ANN002, ANN202
            calls[name] += 1
            return body(*args)

        opaque.body = counted
    return {"results": _equivalence_rank(rank, world_size, tp, cases), "calls": calls}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_sequence_parallel_gpt_with_the_split_equals_one_process(tp: int):
    """The GPT's attention and MLP layers all take the split path (two column- and two
    row-parallel layers per transformer layer, forward and backward) and the model's loss and
    gradients equal the single process's (test_tensor_parallel's check)."""
    from test_tensor_parallel import check_equivalence

    cases = (
        [("default", True, False)] if tp == 4 else [("default", True, False), ("full", True, True)]
    )
    ranks = run_ranks(_split_gpt_rank, tp, tp, cases)
    check_equivalence([r["results"] for r in ranks], cases, tp)
    layers = 2 * len(cases)  # tiny(): 2 layers per case
    for r in ranks:
        assert r["calls"] == {
            "column": 2 * layers,
            "row": 2 * layers,
            "row_backward": 2 * layers,
        }, r
