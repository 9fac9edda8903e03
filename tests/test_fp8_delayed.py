"""``--fp8-recipe delayed`` (``mega.parallel.fp8.delayed``) on the CPU: the scale update, that a
delayed cast is the current cast of the step whose amax it uses (bit for bit, linear and fused
GeLU MLP), training across layouts like one process, and an exact resume from either checkpoint
backend."""

from __future__ import annotations

import json

import pytest
import torch
from test_fp8 import FP8_RUN, fp8_layout_run, fp8_on_cpu, scaled_mm_with_cuda_rules  # noqa: F401
from torch import nn

from mega.core.config.resolve import resolve_config
from mega.parallel.fp8.delayed import GRAD, INPUT, WEIGHT, DelayedScaling, sites_of
from mega.parallel.fp8.linear import fp8_linear
from mega.parallel.fp8.mlp import fp8_gelu_mlp
from mega.parallel.fp8.scaling import E4M3, E5M2
from mega.parallel.linear import Linear

DELAYED = ["--fp8-recipe", "delayed"]


def _linears(n: int, fp8_format: str = "hybrid") -> nn.Module:
    model = nn.Sequential(*(Linear(32, 32, bias=False) for _ in range(n)))
    for layer in model:
        layer.weight.fp8_format = fp8_format
    return model


def _scaling(model: nn.Module, **kwargs) -> DelayedScaling:
    options = {"history_len": 3, "compute_algo": "most_recent", "margin": 0, **kwargs}
    return DelayedScaling(model, groups=[], device=torch.device("cpu"), **options)


def test_the_update_sets_scales_from_the_newest_or_the_largest_amax_and_shifts():
    for algo, expected_input_amax in (("most_recent", 2.0), ("max", 8.0)):
        model = _linears(1)
        layer = model[0]
        scaling = _scaling(model, compute_algo=algo, margin=1)
        layer.fp8_amax_history.copy_(torch.tensor([[2.0, 4.0, 0.0], [8.0, 1.0, 0.0], [1.0] * 3]))
        layer.fp8_scale.fill_(0.5)
        layer.fp8_seeded = False
        scaling.update()
        fmax = torch.finfo(E4M3).max
        assert layer.fp8_scale[INPUT] == fmax / expected_input_amax / 2
        inverses = [layer.fp8_scale_inv_input, layer.fp8_scale_inv_weight, layer.fp8_scale_inv_grad]
        assert torch.equal(torch.stack(inverses), layer.fp8_scale.reciprocal())
        # the weight's scale comes from its recorded amax (4.0, the largest under max too),
        # not from the weight as it is
        assert layer.fp8_scale[WEIGHT] == fmax / 4.0 / 2
        # a site that recorded nothing this step keeps its scale under most_recent
        grad_scale = 0.5 if algo == "most_recent" else torch.finfo(E5M2).max / 1.0 / 2
        assert layer.fp8_scale[GRAD] == grad_scale
        # one row down: this step's amaxes are history now, the oldest row is gone
        expected = torch.tensor([[0.0] * 3, [2.0, 4.0, 0.0], [8.0, 1.0, 0.0]])
        assert torch.equal(layer.fp8_amax_history, expected)
        assert layer.fp8_seeded


def test_a_rank_without_fp8_linears_updates_and_loads_nothing():
    """A pipeline stage whose layers all stay bf16 (--first-last-layers-bf16) has no sites."""
    scaling = _scaling(nn.Sequential(Linear(32, 32)))
    assert scaling.linears == [] and scaling.state() == {}
    scaling.update()
    scaling.loaded()


def _linear_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, sites) -> tuple:
    x = x.clone().requires_grad_()
    out = fp8_linear(x, layer.weight, None, "hybrid", False, sites)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad


def test_a_delayed_linear_casts_as_current_scaling_did_on_the_step_it_recorded():
    """Seeding step: current scaling (bit for bit), amaxes recorded. The next step, on the same
    tensors, casts with scales from those amaxes: the same FP8 values, the same results."""
    torch.manual_seed(0)
    model = _linears(1).to(torch.bfloat16)
    layer = model[0]
    scaling = _scaling(model, history_len=1)  # float32 buffers: after the model's dtype cast
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    grad = (torch.randn(64, 32) * 1e-4).to(torch.bfloat16)
    current = _linear_step(layer, x, grad, None)
    layer.weight.grad = None
    seeding = _linear_step(layer, x, grad, sites_of(layer))
    recorded = layer.fp8_amax_history[0].clone()
    assert torch.equal(recorded[INPUT], x.float().abs().max())
    assert torch.equal(recorded[WEIGHT], layer.weight.float().abs().max())
    assert torch.equal(recorded[GRAD], grad.float().abs().max())
    scaling.update()
    layer.weight.grad = None
    delayed = _linear_step(layer, x, grad, sites_of(layer))
    for a, b, c in zip(current, seeding, delayed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # the delayed casts (the weight's fused one too) recorded the same amaxes again
    assert torch.equal(layer.fp8_amax_history[0], recorded)
    before = layer.fp8_amax_history.clone()
    with torch.no_grad():  # evaluation casts with the scales but records nothing
        fp8_linear(4 * x, layer.weight, None, "hybrid", False, sites_of(layer))
    assert torch.equal(layer.fp8_amax_history, before)


def test_the_fused_gelu_mlp_casts_delayed_as_its_current_scaling_did():
    torch.manual_seed(1)
    model = nn.Sequential(Linear(32, 64), Linear(64, 32, bias=False)).to(torch.bfloat16)
    for layer in model:
        layer.weight.fp8_format = "hybrid"
    fc1, fc2 = model
    scaling = _scaling(model, history_len=2, compute_algo="max")
    x = torch.randn(2, 32, 32, dtype=torch.bfloat16)
    grad = (torch.randn(2, 32, 32) * 1e-3).to(torch.bfloat16)

    def step(sites):
        for p in model.parameters():
            p.grad = None
        inputs = x.clone().requires_grad_()
        out = fp8_gelu_mlp(inputs, fc1.weight, fc1.bias, fc2.weight, False, sites)
        out.backward(grad)
        return [out.detach(), inputs.grad, *(p.grad for p in model.parameters())]

    current = step((None, None))
    seeding = step((sites_of(fc1), sites_of(fc2)))
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, fc1.weight, fc1.bias))
    assert fc2.fp8_amax_history[0, INPUT] > 0.5 * h.float().abs().max()  # FC2's input recorded
    assert fc1.fp8_amax_history[0, GRAD] > 0  # FC1's output gradient recorded in backward
    scaling.update()
    delayed = step((sites_of(fc1), sites_of(fc2)))
    for a, b, c in zip(current, seeding, delayed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        (2, ["--use-distributed-optimizer"]),
        (2, ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]),
    ],
    ids=["dp2-distopt", "pp2"],
)
def test_delayed_fp8_layouts_train_like_one_process(tmp_path, ranks, layout):
    """Bit for bit: the amaxes are max-reduced over the data-parallel ranks, so every rank casts
    each micro-batch with the scales one process uses for it (after the seeding step, which
    is current scaling, per micro-batch wherever it runs)."""
    from parallel_runs import EQUIVALENCE

    args = [*EQUIVALENCE, *FP8_RUN, *DELAYED, "--global-batch-size", "4"]
    args += ["--fp8-amax-history-len", "2", "--fp8-amax-compute-algo", "max"]
    one_args = [*args, *(f for f in layout if f.startswith("--untie"))]
    (one,) = fp8_layout_run(one_args, 1, str(tmp_path / "one"))
    other = fp8_layout_run([*args, *layout], ranks, str(tmp_path / "other"))[0]
    assert other["losses"] == one["losses"] and other["grad_norms"] == one["grad_norms"]
    for name, value in one["params"].items():
        assert torch.equal(other["params"][name], value), name


def _run(args: list[str], run_dir) -> tuple[list[float], dict]:
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine

    plugins = make_plugins()
    config = resolve_config([*args, "--run-dir", str(run_dir)], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    state = {k: v.clone() for k, v in engine.fp8_scaling.state().items()}
    return [row["lm_loss"] for row in rows if "lm_loss" in row], state


@pytest.mark.usefixtures("fp8_on_cpu")
@pytest.mark.parametrize("ckpt_format", ["zarr", "torch"])
def test_delayed_fp8_resumes_exactly(tmp_path, ckpt_format):
    """The amax histories and scales are in the checkpoint: resumed at step 3, steps 4-6 are
    the uninterrupted run's bit for bit, and so are the histories at the end. (Started without
    them, step 4 would seed again with current scaling and differ.)"""
    from conftest import TINY

    args = [*TINY, "--bf16", "--fp8-format", "hybrid", *DELAYED, "--device", "cpu"]
    args += ["--train-iters", "6", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    args += ["--log-interval", "1", "--ckpt-format", ckpt_format]
    full, full_state = _run(args, tmp_path / "full")
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    _run([*args, *ckpt, "--exit-interval", "3"], tmp_path / "first")
    resumed, state = _run([*args, "--load", str(tmp_path / "ckpt")], tmp_path / "resumed")
    assert resumed == full[3:]
    assert state.keys() == full_state.keys() and len(state) > 0
    for key, value in full_state.items():
        assert torch.equal(state[key], value), key


def _histories_rank(rank: int, world_size: int, args: list[str], run_dir: str) -> dict:
    from test_fp8 import allow_fp8_on_cpu

    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine

    allow_fp8_on_cpu()
    plugins = make_plugins()
    config = resolve_config([*args, "--run-dir", run_dir], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()
    return {k: v.clone() for k, v in engine.fp8_scaling.state().items()}


def test_tensor_parallel_ranks_share_the_whole_tensors_amaxes(tmp_path):
    """Under TP2+SP each rank casts shards (of weights, of row-parallel inputs, of gradients):
    the update max-reduces over the tensor-parallel group too, so after the first step both
    ranks hold the same histories, those of the whole tensors: the weights' amaxes are one
    process's exactly (the same initial weights), and so is the first layer's input (the same
    embeddings). The other amaxes come after FP8 GEMMs whose shards were cast with their own
    scales in that first (current-scaling) step: within E5M2's roundoff of one process's."""
    from mega.testing.ranks import run_ranks

    from parallel_runs import EQUIVALENCE

    args = [*EQUIVALENCE, *FP8_RUN, *DELAYED, "--fp8-amax-history-len", "2"]
    args += ["--global-batch-size", "4", "--train-iters", "1"]
    (one,) = run_ranks(_histories_rank, 1, args, str(tmp_path / "one"), timeout=240)
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    ranks = run_ranks(_histories_rank, 2, [*args, *tp], str(tmp_path / "tp"), timeout=240)
    assert ranks[0].keys() == one.keys()
    histories = [k for k in one if k.endswith(".amax_history")]
    for key in one:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    for key in histories:
        step, expected = ranks[0][key][1], one[key][1]  # row 1: the first step, shifted down
        assert torch.equal(step[WEIGHT], expected[WEIGHT]), key
        torch.testing.assert_close(step, expected, rtol=2.0**-3, atol=0, msg=key)
    first = "decoder.layers.0.self_attention.linear_qkv.amax_history"
    assert torch.equal(ranks[0][first][1, INPUT], one[first][1, INPUT])
