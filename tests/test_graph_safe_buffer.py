"""The gradient buffer under CUDA graph replays (``graph_safe``, ``--cuda-graph-impl local``).

A replayed backward runs each fused weight-gradient GEMM as it was captured (overwrite or add,
chosen once) and none of the Python around it: no flag is set again. Here a replay is imitated on
the CPU by letting each weight's first fused GEMM run as usual (the capture) and every later one
run only the GEMM with the captured choice. Over two steps of two micro-batches the graph-safe
buffer must give the gradients of the plain run, and the default buffer must not (its first
micro-batch overwrites, its hook relies on a flag the replay never sets again): the imitation
is faithful enough to catch what a real replay broke."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mega.parallel import weight_grad
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.topology import Topology


def _layer_and_buffer(graph_safe: bool) -> tuple[nn.Module, ParamAndGradBuffer]:
    from mega.plugins.models.common.config import GPTConfig
    from mega.plugins.models.common.layers import TransformerLayer

    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    torch.manual_seed(0)
    layer = TransformerLayer(cfg)
    buffer = ParamAndGradBuffer.build(layer, Topology(), graph_safe=graph_safe)
    for param in buffer.params:
        param.fuse_wgrad = True
    return layer, buffer


def _steps(layer: nn.Module, buffer: ParamAndGradBuffer) -> list[torch.Tensor]:
    torch.manual_seed(1)
    grads = []
    for _ in range(2):
        buffer.start_step(2)
        for _ in range(2):
            layer(torch.randn(2, 8, 32)).square().sum().backward()
        buffer.finish_grad_sync()
        grads.append(buffer.main_grad.clone())
    return grads


def _replaying(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[int, bool] = {}  # weight -> the overwrite choice its capture made
    capture = weight_grad._accumulate_into

    def replay(weight, gemm, operands):  # noqa: ANN001, ANN202
        if id(weight) not in captured:
            captured[id(weight)] = getattr(weight, "main_grad_fresh", False)
            capture(weight, gemm, operands)
        else:  # the GEMM alone, as captured: no flag read or written
            gemm(weight.main_grad, *operands, overwrite=captured[id(weight)])

    monkeypatch.setattr(weight_grad, "_accumulate_into", replay)


def test_graph_safe_gradients_survive_replays_that_the_default_buffer_gets_wrong(monkeypatch):
    reference = _steps(*_layer_and_buffer(graph_safe=False))
    assert all(g.abs().sum() > 0 for g in reference)
    _replaying(monkeypatch)
    safe = _steps(*_layer_and_buffer(graph_safe=True))
    for got, want in zip(safe, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    default = _steps(*_layer_and_buffer(graph_safe=False))
    assert not all(torch.allclose(g, w) for g, w in zip(default, reference, strict=True))


def test_after_its_first_step_a_graph_safe_buffer_zeroes_only_what_the_graphs_add_into(
    monkeypatch,
):
    """Gradients that reach main_grad through the hook run eagerly after a graphed backward:
    once seen so they copy their first micro-batch as without graphs (no zeroing, no add); the
    weights whose captured GEMMs write main_grad, and any parameter not yet seen, are zeroed
    and always add."""
    _replaying(monkeypatch)
    layer, buffer = _layer_and_buffer(graph_safe=True)
    buffer.start_step(1)
    assert all(not p.main_grad_fresh for p in buffer.params)  # the first step: all add
    layer(torch.randn(2, 8, 32)).square().sum().backward()
    buffer.finish_grad_sync()
    fused = {id(p) for p in buffer.params if getattr(p, "main_grad_by_gemm", False)}
    hooked = [p for p in buffer.params if id(p) not in fused]
    assert fused and hooked  # the linears' weights; the norms' parameters and the biases
    before = [p.main_grad.clone() for p in hooked]
    buffer.start_step(1)
    for param in buffer.params:
        assert param.main_grad_fresh == (id(param) not in fused)
        if id(param) in fused:
            assert not param.main_grad.any()
    for param, kept in zip(hooked, before, strict=True):
        assert torch.equal(param.main_grad, kept) and kept.any()


def test_a_parameter_not_yet_seen_is_zeroed_and_added_under_graphs():
    """A weight that first gets a gradient after the first step (a layer skipped until then)
    may be a fused one whose graph adds: until its hook has shown how its gradient comes it is
    zeroed each step and never marked for a copy."""
    layer, buffer = _layer_and_buffer(graph_safe=True)
    for param in buffer.params:
        param.main_grad.fill_(3.0)
    buffer.start_step(1)  # nothing seen yet
    assert not buffer.main_grad.any()
    assert all(not p.main_grad_fresh for p in buffer.params)
    layer(torch.randn(2, 8, 32)).square().sum().backward()
    buffer.finish_grad_sync()
    unseen = next(p for p in buffer.params if getattr(p, "main_grad_by_hook", False))
    del unseen.main_grad_by_hook  # as if its layer had not run yet
    unseen.main_grad.fill_(3.0)
    buffer.start_step(1)
    assert not unseen.main_grad_fresh and not unseen.main_grad.any()
