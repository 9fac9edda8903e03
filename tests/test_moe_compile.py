"""MoE layers under ``torch.compile`` (on by default on a GPU): the dropless single-device path
has no data-dependent shapes, so the router and the token shuffle trace as one graph, and the
auxiliary losses' backward scale is read at run time, not frozen into the compiled backward."""

from __future__ import annotations

import copy

import pytest
import torch

from mega import BuildContext
from mega.core.config.resolve import resolve_config
from mega.core.plugins.manager import make_plugins
from mega.parallel.expert.aux_loss import set_backward_scale
from mega.parallel.expert.local import local_mixture

from conftest import run_workers


def _routing(tokens: int = 32, k: int = 2, experts: int = 4):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, experts, generator=g)
    probs, indices = torch.topk(torch.softmax(logits, -1), k, dim=1)
    return torch.randn(tokens, 8, generator=g), probs, indices


def _graph_breaks(complete: bool) -> int:
    x, probs, indices = _routing()

    def mixture(x, probs, indices):
        # experts that ignore the counts: only the routing's own shuffle is traced
        return local_mixture(x, probs, indices, lambda y, counts: 2 * y, 0, 4, complete=complete)

    return torch._dynamo.explain(mixture)(x, probs, indices).graph_break_count


def test_the_dropless_local_shuffle_traces_without_graph_breaks():
    torch._dynamo.reset()
    assert _graph_breaks(complete=True) == 0
    # with drops or expert parallelism, experts that are no grouped GEMM read the held rows'
    # count on the host (test_moe_held_mixture: a grouped GEMM's do not)
    assert _graph_breaks(complete=False) > 0


def test_the_complete_path_equals_the_general_one_with_its_gradients():
    x, probs, indices = _routing(k=3)
    experts = lambda y, counts: torch.cat(  # noqa: E731  a different function per expert
        [piece.square() * (e + 1) for e, piece in enumerate(y.split(counts.tolist()))]
    )
    results = []
    for complete in (False, True):
        inputs = (x.clone().requires_grad_(), probs.clone().requires_grad_())
        out = local_mixture(*inputs[:1], inputs[1], indices, experts, 0, 4, complete=complete)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out, inputs[0].grad, inputs[1].grad))
    for general, complete in zip(*results, strict=True):
        torch.testing.assert_close(complete, general, rtol=1e-6, atol=1e-6)


def _moe_model(*flags: str) -> torch.nn.Module:
    """A one-layer MoE model (hidden 32, 4 heads, experts of ffn 16) with ``flags``, on the CPU."""
    plugins = make_plugins()
    config = resolve_config(
        ["--model", "moe", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
         "4", "--moe-ffn-hidden-size", "16", *flags],
        plugins,
    )  # fmt: skip
    ctx = BuildContext(
        seed=1, device="cpu", params_dtype="float32", seq_length=16, padded_vocab_size=128,
        tokenizer=None, topology=None,
    )  # fmt: skip
    return plugins.models.get("moe").build(config.model, ctx)


def _moe_layer() -> torch.nn.Module:
    return _moe_model("--moe-z-loss-coeff", "1e-3").decoder.layers[0].train()


def test_a_compiled_layer_scales_the_aux_loss_gradient_as_it_is_set_at_run_time():
    torch._dynamo.reset()
    eager = _moe_layer()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    for scale in (1.0, 0.25):  # the compiled backward is traced at the first scale
        set_backward_scale(scale, torch.device("cpu"))
        grads = []
        for layer in (eager, compiled):
            layer.zero_grad()
            # a main loss with no gradient: the router's gradient is the auxiliary losses' alone
            (layer(x.clone()).sum() * 0).backward()
            grads.append(layer.mlp.router.weight.grad.clone())
        assert grads[0].abs().max() > 0
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=0)
    set_backward_scale(1.0)


def _frames_for_routings(capacity_factor: str | None) -> list[int]:
    """Frames dynamo has compiled after each of four training forwards and backwards of one
    compiled MoE layer, on inputs of one shape whose routings differ: other rows per expert,
    and with a capacity other slots kept. One eager forward first: the router's statistics
    then hold every sum already, as they do from a run's second micro-batch on."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    flags = ["--moe-expert-capacity-factor", capacity_factor] if capacity_factor else []
    layer = _moe_model("--num-experts", "4", *flags).decoder.layers[0].train()
    g = torch.Generator().manual_seed(2)
    layer(torch.randn(2, 16, 32, generator=g))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter)
    frames = []
    for _ in range(4):
        x = torch.randn(2, 16, 32, generator=g)
        compiled(x).sum().backward()
        frames.append(counter.frame_count)
    return frames


def test_a_compiled_moe_layer_compiles_once_whatever_its_routing():
    """The experts' loop (CPU, or no --moe-grouped-gemm) splits rows by expert on the host, and
    with a capacity the slots kept are found by ``nonzero``: the graphs after them take sizes
    the routing sets. They compile once for all sizes (mega.parallel.expert.traced); before,
    each recompiled at its second call, and again at sizes that happened to repeat."""
    for capacity_factor in (None, "1.0"):
        frames = _frames_for_routings(capacity_factor)
        assert frames[1:] == frames[:1] * 3, (capacity_factor, frames)


def test_a_compiled_moe_layer_compiles_once_from_its_first_call_through_log_lines():
    """The router's statistics hold every sum it records from the start, at zero on its
    device: the dict a compiled forward adds to has the same keys at every call, and again after
    an iteration line takes them (``router_metrics``). Before, the first micro-batch compiled
    with an empty dict and the second once more (8, 9, 9, 9 frames here)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from mega.parallel.expert.stats import router_metrics
    from mega.parallel.topology import Topology

    torch._dynamo.reset()
    set_backward_scale(1.0, torch.device("cpu"))  # as the executor does before each step
    model = _moe_model("--num-experts", "4", "--moe-z-loss-coeff", "1e-3")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model.decoder.layers[0].train(), backend=counter)
    g = torch.Generator().manual_seed(2)
    frames = []
    for call in range(4):
        compiled(torch.randn(2, 16, 32, generator=g)).sum().backward()
        frames.append(counter.frame_count)
        if call == 1:  # an iteration line
            metrics = router_metrics(model, Topology())
            assert metrics["z_loss"] > 0 and sum(metrics["expert_load"]) == pytest.approx(1.0)
    assert frames == frames[:1] * 4, frames


def _dispatch_explained(pad: bool):  # noqa: ANN202
    from mega.parallel.expert.dispatchers import AllToAllDispatcher
    from mega.plugins.models.common.moe import Routing

    tokens, k, experts_n = 32, 2, 4
    x, probs, indices = _routing(tokens, k, experts_n)

    class Experts:  # experts that ignore the counts: only the dispatch is traced
        count, first = experts_n, 0

        def __call__(self, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return 2 * y

    dispatcher, experts = AllToAllDispatcher(None), Experts()

    def dispatch(x, probs, indices):
        return dispatcher(x, Routing(probs, indices, tokens, pad), experts)

    return torch._dynamo.explain(dispatch)(x, probs, indices)


def test_the_alltoall_dispatch_padded_to_capacity_traces_without_graph_breaks():
    # drop-and-pad has fixed splits: one graph; the counted all-to-all's splits are host
    # integers, so its two trips run eager and the rest is traced: the sort, the experts
    # between the trips and the mixing after them (three graphs, two breaks)
    torch._dynamo.reset()
    padded = _dispatch_explained(pad=True)
    assert (padded.graph_count, padded.graph_break_count) == (1, 0)
    counted = _dispatch_explained(pad=False)
    assert (counted.graph_count, counted.graph_break_count) == (3, 2)
    assert all("disable" in str(b.reason) for b in counted.break_reasons)


def test_the_compiled_alltoall_dispatch_compiles_once_and_matches_eager_on_two_ranks():
    """The counted all-to-all traced around its two eager trips, on two gloo ranks, four
    routings: the same outputs and gradients as eager and as every expert on one process, and no
    new graph for new row counts (tests/moe_dispatch_compile_worker.py; the experts' rows unmarked
    as unbacked, the third call compiled anew: frames 4, 4, 5, 5)."""
    stdout = run_workers("moe_dispatch_compile_worker.py", 2)
    assert stdout.count("compiled alltoall matches eager") == 2, stdout[-2000:]


def test_the_overlapped_flex_dispatch_compiles_once_and_matches_eager_on_two_ranks():
    """flex with its trips overlapped (``--overlap-moe-expert-parallel-comm``): torch.compile
    calls the overlapped part eager (streams are not traced), the same outputs and gradients as
    eager and as one process, and no recompile over four routings (marking the part at the first
    traced call once recompiled the layer)."""
    env = {"MOE_DISPATCHER": "flex-overlap"}
    stdout = run_workers("moe_dispatch_compile_worker.py", 2, env)
    assert stdout.count("compiled flex-overlap matches eager") == 2, stdout[-2000:]


def test_the_pipelined_flex_dispatch_matches_eager_and_one_process_on_two_ranks():
    """flex overlapped over the padded trips (``--overlap-moe-expert-parallel-comm`` with
    ``MEGA_FLEX_TRANSPORT=padded``): two chunks, each trip begun early and ended late on one
    stream, traced (aot_eager here; on GPUs with inductor as one graph:
    tests/test_gpu_moe_flex.py), the same outputs and gradients as eager and as one process, no
    recompile over four routings."""
    env = {"MOE_DISPATCHER": "flex-overlap", "MEGA_FLEX_TRANSPORT": "padded", "MOE_PIPELINED": "1"}
    stdout = run_workers("moe_dispatch_compile_worker.py", 2, env)
    assert stdout.count("compiled flex-overlap matches eager") == 2, stdout[-2000:]


def test_flex_by_padded_all_to_alls_compiles_once_and_matches_eager_on_two_ranks():
    """``MEGA_FLEX_TRANSPORT=padded``: flex's trips as all-to-alls of fixed splits and index maps
    made on the device, traced with the layer: the same outputs and gradients as eager and as
    one process, and no recompile over four routings (tests/moe_dispatch_compile_worker.py)."""
    env = {"MOE_DISPATCHER": "flex-padded", "MEGA_FLEX_TRANSPORT": "padded"}
    stdout = run_workers("moe_dispatch_compile_worker.py", 2, env)
    assert stdout.count("compiled flex-padded matches eager") == 2, stdout[-2000:]


def test_the_pipelined_trips_overlap_the_expert_gemms_as_inductor_compiles_them():
    """The GPU's pipelined layer (grouped GEMM in bf16, which torch runs on the CPU too) compiled
    by inductor with its compile options (the sink_waits pass) on two gloo ranks: in the
    generated forward and backward, trips start before expert GEMMs that run before their waits
    (without the pass every trip was waited at once: 0 overlapped), and the numbers are eager's
    to bf16's rounding (tests/pipelined_order_worker.py)."""
    stdout = run_workers("pipelined_order_worker.py", 2, {"MEGA_FLEX_TRANSPORT": "padded"})
    assert stdout.count("pipelined trips overlap the expert GEMMs") == 2, stdout[-2000:]
