"""The slots an expert-parallel rank holds among others (``allgather``), or those a capacity
kept, mixed without a shape that depends on the routing (``held_mixture``): equal to the
mixture written out token by token, gradients included, when the experts' grouped GEMM leaves
garbage past its groups as a GPU's does (here NaN, the worst garbage), and one graph when
compiled. Before, the held slots were found on the host (``nonzero``, ``bincount``): a sync per
layer and micro-batch, and a graph break."""

from __future__ import annotations

import pytest
import torch

from mega.parallel.expert import local
from mega.parallel.expert.local import local_mixture

EXPERTS, HIDDEN = 4, 8


class PoisonedGroupedExperts:
    """Expert ``e`` maps a row to ``row**2 * (e + 1) + e``; like a grouped GEMM it computes only
    the rows of its groups (offsets on the device, no sync) and leaves the rest as NaN."""

    grouped_gemm = True

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(counts, 0)
        rows = torch.arange(x.shape[0], device=x.device)
        expert = torch.searchsorted(ends, rows, right=True)  # counts.numel() past the groups
        out = x.square() * (expert + 1).unsqueeze(1) + expert.unsqueeze(1)
        return torch.where((rows < ends[-1]).unsqueeze(1), out, torch.nan)


def _expert(e: int, row: torch.Tensor) -> torch.Tensor:
    return row.square() * (e + 1) + e


def _written_out(x, probs, indices, first: int, count: int) -> torch.Tensor:
    """The mixture token by token: the held slots' expert outputs, weighted, summed."""
    out = []
    for t in range(x.shape[0]):
        total = torch.zeros(HIDDEN)
        for j in range(indices.shape[1]):
            e = int(indices[t, j]) - first
            if int(indices[t, j]) >= 0 and 0 <= e < count:
                total = total + probs[t, j] * _expert(e, x[t])
        out.append(total)
    return torch.stack(out)


def _routing(tokens: int, k: int, dropped: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    probs, indices = torch.topk(torch.softmax(torch.randn(tokens, EXPERTS, generator=g), -1), k)
    drop = torch.rand(tokens, k, generator=g) < dropped
    return torch.randn(tokens, HIDDEN, generator=g), probs, indices.masked_fill(drop, -1)


@pytest.fixture
def grouped(monkeypatch):
    """The experts run as the GPU's grouped GEMM does, on the CPU."""
    monkeypatch.setattr(local, "GROUPED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(local, "grouped_on_gpu", lambda rows, experts: True)


@pytest.mark.parametrize(
    ("first", "count", "dropped"),
    [(0, 2, 0.0), (2, 2, 0.0), (1, 2, 0.2), (0, 4, 0.3), (3, 1, 0.0)],
    ids=["ep2-rank0", "ep2-rank1", "middle-with-drops", "all-held-with-drops", "one-expert"],
)
def test_the_held_slots_mix_as_written_out_with_their_gradients(grouped, first, count, dropped):
    x, probs, indices = _routing(tokens=24, k=2, dropped=dropped, seed=first + count)
    inputs = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
    reference = [x.clone().requires_grad_(), probs.clone().requires_grad_()]

    out = local_mixture(*inputs, indices, PoisonedGroupedExperts(), first, count, total=EXPERTS)
    expected = _written_out(*reference, indices, first, count)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    out.backward(weights)
    expected.backward(weights)

    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(inputs, reference, strict=True):
        assert torch.isfinite(got.grad).all()  # the NaN rows past the groups never leak
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


def test_the_loop_path_reads_the_count_and_matches_too():
    """On the CPU without a grouped GEMM the experts run the grouped rows alone."""
    x, probs, indices = _routing(tokens=16, k=2, dropped=0.1, seed=7)

    def loop(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        pieces = rows.split(counts.tolist())
        return torch.cat([_expert(e, piece) for e, piece in enumerate(pieces)])

    out = local_mixture(x, probs, indices, loop, 2, 2, total=EXPERTS)
    torch.testing.assert_close(out, _written_out(x, probs, indices, 2, 2), rtol=1e-5, atol=1e-5)


def test_an_expert_parallel_rank_compiles_as_one_graph(grouped):
    """Nothing in the mixture reads the routing on the host: no graph break."""
    torch._dynamo.reset()
    x, probs, indices = _routing(tokens=16, k=2, dropped=0.1, seed=3)

    def mixture(x, probs, indices):
        return local_mixture(x, probs, indices, PoisonedGroupedExperts(), 2, 2, total=EXPERTS)

    explained = torch._dynamo.explain(mixture)(x, probs, indices)
    assert explained.graph_break_count == 0, explained.break_reasons
