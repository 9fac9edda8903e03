"""FP8 linears (``mega.parallel.fp8``) on the CPU, where torch runs ``_scaled_mm`` too: the casts,
the three GEMMs against float64 within the formats' rounding, the fused and deferred weight
gradient, which weights the plan marks, and the flags refused before launch. Training in FP8
needs a Hopper GPU: tests/test_gpu_fp8.py."""

from __future__ import annotations

import pytest
import torch

from mega import BuildContext
from mega.core.config.resolve import resolve_config
from mega.errors import MegaUsageError
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.fp8.apply import apply_fp8
from mega.parallel.fp8.linear import fp8_linear
from mega.parallel.fp8.scaling import E4M3, E5M2, to_fp8
from mega.parallel.linear import Linear
from mega.parallel.topology import Topology
from mega.parallel.weight_grad import deferring_weight_grads

from conftest import TINY


def _with_cuda_rules(real):  # noqa: ANN001, ANN202
    def checked(a, b, *args, **kwargs):
        assert a.is_contiguous(), f"first operand not row-major: {tuple(a.stride())}"
        assert b.t().is_contiguous(), f"second operand not column-major: {tuple(b.stride())}"
        sizes = (*a.shape, b.shape[1])
        assert all(n % 16 == 0 for n in sizes), f"GEMM sizes {sizes} not multiples of 16"
        return real(a, b, *args, **kwargs)

    checked.cuda_rules = True
    return checked


def enforce_cuda_rules() -> None:
    """Make this process's ``torch._scaled_mm`` check CUDA's rules first. Called in each rank
    too: ranks started from a forkserver (once the test process used tensorstore) do not
    inherit a patch made in the test process."""
    if not getattr(torch._scaled_mm, "cuda_rules", False):
        torch._scaled_mm = _with_cuda_rules(torch._scaled_mm)


@pytest.fixture(autouse=True)
def scaled_mm_with_cuda_rules(monkeypatch):
    """The CPU's ``_scaled_mm`` accepts what CUDA's refuses: every test here runs it with CUDA's
    rules checked first (first operand row-major, second column-major, every dimension a
    multiple of 16), so a layout or size that would fail on a GPU fails here."""
    monkeypatch.setattr(torch, "_scaled_mm", _with_cuda_rules(torch._scaled_mm))


# unit roundoff (half the spacing relative to a value) of each format's normal numbers
ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
# spacing of the subnormals, in the scaled domain (absolute)
SUBNORMAL_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16}


def cast_error_bound(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest |t - dequantised(t)| per element: a relative roundoff for normal numbers, half a
    subnormal step (in t's units: divided by the scale) for the smallest ones."""
    scale = torch.finfo(dtype).max / t.abs().amax().double()
    return t.abs().double() * ROUNDOFF[dtype] + SUBNORMAL_STEP[dtype] / 2 / scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_cast_maps_the_amax_to_the_largest_value_and_rounds_within_the_format(dtype):
    torch.manual_seed(0)
    t = torch.randn(64, 96) * 3
    data, inverse = to_fp8(t, dtype)
    assert data.dtype == dtype
    assert data.float().abs().max() == torch.finfo(dtype).max  # the amax element, exactly
    error = (data.double() * inverse.double() - t.double()).abs()
    assert (error <= cast_error_bound(t, dtype) * (1 + 1e-6)).all()
    zero, inverse = to_fp8(torch.zeros(4, 16), dtype)  # an all-zero tensor stays finite
    assert zero.float().abs().sum() == 0 and torch.isfinite(inverse)


def test_the_column_first_amax_is_the_same_scale():
    torch.manual_seed(0)
    t = torch.randn(64, 48) * torch.rand(64, 48) ** 4  # a long tail: the amax is one element
    for dtype in (E4M3, E5M2):
        data, inverse = to_fp8(t, dtype)
        data_c, inverse_c = to_fp8(t, dtype, columns_first=True)
        assert torch.equal(inverse, inverse_c) and torch.equal(data.float(), data_c.float())


def product_error_bound(a: torch.Tensor, b: torch.Tensor, ua: float, ub: float) -> torch.Tensor:
    """Bound on ``|a_q @ b_q - a @ b|`` when each entry of a and b carries a relative error of at
    most ua and ub (subnormals aside: the operands below are far from them): per term
    ``|a||b| (ua + ub + ua ub)``, plus float32 accumulation (negligible) and the bf16 rounding of
    the output (2^-8 of |result|, added by the caller)."""
    return (a.abs().double() @ b.abs().double()) * (ua + ub + ua * ub)


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_the_three_gemms_match_float64_within_the_formats_rounding(fp8_format):
    torch.manual_seed(0)
    # values spread over a few binades, away from the subnormals (the bound above ignores them)
    x = (torch.rand(2, 32, 64) + 0.5) * torch.randn(2, 32, 64).sign()
    w = torch.nn.Parameter(((torch.rand(48, 64) + 0.5) * torch.randn(48, 64).sign()) / 8)
    b = torch.nn.Parameter(torch.randn(48))
    g = (torch.rand(2, 32, 48) + 0.5) * torch.randn(2, 32, 48).sign()
    x.requires_grad_()
    y = fp8_linear(x, w, b, fp8_format, fuse_wgrad=False)
    y.backward(g)

    u4, ug = ROUNDOFF[E4M3], ROUNDOFF[E4M3 if fp8_format == "e4m3" else E5M2]
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    x2, g2 = x64.reshape(-1, 64), g64.reshape(-1, 48)
    expected = {
        "output": (x2 @ w64.t() + b.double(), product_error_bound(x2, w64.t(), u4, u4)),
        "input grad": (g2 @ w64, product_error_bound(g2, w64, ug, u4)),
        "weight grad": (g2.t() @ x2, product_error_bound(g2.t(), x2, ug, u4)),
    }
    got = {
        "output": y.detach().reshape(-1, 48),
        "input grad": x.grad.reshape(-1, 64),
        "weight grad": w.grad,
    }
    for name, (exact, bound) in expected.items():
        error = (got[name].double() - exact).abs()
        assert (error <= bound * 1.001 + 1e-6).all(), name
        # and FP8 really is in use: float32 GEMMs would be ~1e-6 off, FP8 ones much more
        assert error.max() > 1e-3, name
    torch.testing.assert_close(b.grad.double(), g2.sum(0), rtol=1e-6, atol=1e-5)


def fused_layer() -> tuple[Linear, ParamAndGradBuffer]:
    torch.manual_seed(0)
    layer = Linear(64, 32)
    layer.weight.fp8_format = "hybrid"
    buffer = ParamAndGradBuffer.build(layer, Topology())
    layer.weight.fuse_wgrad = True
    return layer, buffer


def test_the_fused_fp8_weight_gradient_overwrites_then_accumulates_into_main_grad():
    layer, buffer = fused_layer()
    xs = [torch.randn(16, 64) for _ in range(3)]
    for _ in range(2):  # the second step must start from its own first micro-batch
        buffer.start_step(len(xs))
        for x in xs:
            layer(x).sum().backward()
        buffer.finish_grad_sync()
    w = layer.weight.detach().clone().requires_grad_()  # the same GEMMs, unfused
    for x in xs:
        fp8_linear(x, w, None, "hybrid", fuse_wgrad=False).sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, w.grad, rtol=1e-6, atol=1e-6)


def test_deferred_fp8_weight_gradients_wait_for_the_queue():
    layer, buffer = fused_layer()
    x = torch.randn(16, 64)
    buffer.start_step(1)
    layer.weight.main_grad.fill_(7.0)  # what a missing write would leave
    with deferring_weight_grads() as queue:
        layer(x).sum().backward()
    assert len(queue) == 1 and (layer.weight.main_grad == 7.0).all()
    queue.run()
    buffer.finish_grad_sync()
    w = layer.weight.detach().clone().requires_grad_()
    fp8_linear(x, w, None, "hybrid", fuse_wgrad=False).sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, w.grad, rtol=1e-6, atol=1e-6)


def tiny_gpt(plugins, layers: int = 4):
    from mega.plugins.models.common.decoder_plan import gpt_parallel_plan

    args = [*TINY, "--num-layers", str(layers), "--untie-embeddings-and-output-weights"]
    config = resolve_config(args, plugins)
    ctx = BuildContext(
        seed=1, device="cpu", params_dtype="float32", seq_length=32, padded_vocab_size=128,
        tokenizer=None, topology=None,
    )  # fmt: skip
    model = plugins.models.get("gpt").build(config.model, ctx)
    return model, gpt_parallel_plan(config.model)


def test_the_plan_marks_the_layers_linears_and_keeps_first_and_last_in_bf16(plugins):
    model, plan = tiny_gpt(plugins)
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
               "mlp.linear_fc2")  # fmt: skip
    marked = apply_fp8(model, plan, "hybrid", bf16_at_start=1, bf16_at_end=1)
    assert sorted(marked) == sorted(f"decoder.layers.{i}.{n}" for i in (1, 2) for n in linears)
    fp8 = {name for name, p in model.named_parameters() if getattr(p, "fp8_format", None)}
    assert fp8 == {f"{path}.weight" for path in marked}  # biases, norms, output layer: bf16

    model, plan = tiny_gpt(plugins)
    assert len(apply_fp8(model, plan, "e4m3")) == 16  # all four layers without the flag


def test_a_pipeline_stage_counts_layers_globally(plugins):
    """The last stage holding layers 2 and 3 of 4 keeps layer 3 (the model's last) in bf16."""
    from mega.parallel.pipeline.layout import PipelineLayout
    from mega.parallel.pipeline.split import split_for_pipeline

    model, plan = tiny_gpt(plugins)
    rank_model, _ = split_for_pipeline(
        model, plan, PipelineLayout(pp=2, vpp=1, stages=(range(0, 2), range(2, 4))), 1
    )
    marked = apply_fp8(rank_model, plan, "hybrid", bf16_at_start=1, bf16_at_end=1)
    assert {path.split(".")[2] for path in marked} == {"2"}


def test_a_linear_that_would_silently_stay_bf16_is_refused(plugins):
    model, plan = tiny_gpt(plugins, layers=2)
    model.decoder.layers[0].mlp.linear_fc2 = torch.nn.Linear(128, 32)  # not mega's Linear
    with pytest.raises(MegaUsageError, match="decoder.layers.0.mlp.linear_fc2"):
        apply_fp8(model, plan, "hybrid")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fp8-format", "hybrid", "--bf16", "--device", "cpu"], "needs an NVIDIA GPU"),
        (["--fp8-format", "hybrid", "--device", "cpu"], "needs --bf16"),
        (["--fp8-format", "e4m3", "--bf16", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8"),
        (["--fp8-format", "e4m3", "--bf16", "--fp8-amax-history-len", "0"], "history-len"),
        (["--fp8-format", "fp4"], "fp4"),
        (["--num-layers-at-start-in-bf16", "-1"], "must not be negative"),
        (["--fp8-format", "hybrid", "--bf16", "--seq-length", "30"], "multiple of 16"),
        (
            ["--model", "t5", "--fp8-format", "hybrid", "--bf16", "--decoder-seq-length", "10"],
            "--decoder-seq-length",
        ),
        (["--fp8-format", "hybrid", "--bf16", "--first-last-layers-bf16"], "no linear would run"),
    ],
)
def test_what_cannot_run_fp8_is_refused_before_launch(mega_cli, flags, message):
    result = mega_cli(["train", *TINY, "--train-iters", "1", *flags])
    assert result.exit_code == 2
    assert message in result.stderr


# ---------------------------------------------------------------- FP8 with data/tensor parallelism


def allow_fp8_on_cpu() -> None:
    """Let this process train in FP8 on the CPU, which runs ``_scaled_mm`` too (users are refused
    there: no FP8 tensor cores, no speed to gain), with CUDA's GEMM rules enforced. Each rank
    calls it itself (see ``enforce_cuda_rules``)."""
    from mega.parallel.fp8 import checks

    checks.fp8_device_problems = lambda flag, device: []
    checks.rank_device_problems = lambda flag, device: []
    enforce_cuda_rules()


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """``allow_fp8_on_cpu`` in the test process, undone afterwards."""
    from mega.parallel.fp8 import checks

    monkeypatch.setattr(checks, "fp8_device_problems", lambda flag, device: [])
    monkeypatch.setattr(checks, "rank_device_problems", lambda flag, device: [])


def _fp8_rank(rank: int, world_size: int, args: list[str], run_dir: str) -> dict:
    from parallel_runs import _train

    allow_fp8_on_cpu()
    return _train(rank, world_size, args, run_dir)


def fp8_layout_run(args: list[str], world_size: int, run_dir: str) -> list[dict]:
    from mega.testing.ranks import run_ranks

    return run_ranks(_fp8_rank, world_size, args, run_dir, timeout=240)


UNTIED = "--untie-embeddings-and-output-weights"
FP8_RUN = ["--bf16", "--fp8-format", "hybrid", "--device", "cpu", "--train-iters", "4"]


@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        (2, ["--use-distributed-optimizer"]),
        # untied: tied embeddings sum their two stages' gradients in another order (bf16 too)
        (2, ["--pipeline-model-parallel-size", "2", "--parallel", "1f1b-zb", UNTIED]),
        (
            1,
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
        ),
    ],
    ids=["dp2-distopt", "pp2-zero-bubble", "recompute"],
)
def test_fp8_layouts_train_like_one_process(tmp_path, ranks, layout):
    """Against one process, both FP8, bit for bit. Each micro-batch is cast with its own scales
    wherever it runs (a DP rank, a pipeline stage, a recomputed forward), so the FP8 GEMMs are the
    same; the zero-bubble schedule runs the weight-gradient op from its queue. With two
    micro-batches per step their gradients meet in one fp32 addition either way (the second
    micro-batch's accumulate, or DP's reduce-scatter), so nothing may differ. (With more
    micro-batches DP orders the sums differently: FP8 results carry arbitrary fp32 scales, so the
    order shows, and a bf16 weight one ulp apart recasts differently.)"""
    from parallel_runs import EQUIVALENCE

    args = [*EQUIVALENCE, *FP8_RUN, "--global-batch-size", "4"]
    one_args = [*args, *(f for f in layout if f == UNTIED)]
    (one,) = fp8_layout_run(one_args, 1, str(tmp_path / "one"))
    other = fp8_layout_run([*args, *layout], ranks, str(tmp_path / "other"))[0]
    assert other["losses"] == one["losses"] and other["grad_norms"] == one["grad_norms"]
    for name, value in one["params"].items():
        assert torch.equal(other["params"][name], value), name


def _tp_linear_rank(rank, world_size, style, sequence_parallel):
    import torch.distributed as dist

    from mega.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
    from mega.parallel.topology import build_topology

    enforce_cuda_rules()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = build_topology(world_size, rank, tp=world_size).group("tp")
    torch.manual_seed(0)  # the same full tensors on every rank
    full = torch.nn.Linear(64, 96, bias=False)
    with torch.no_grad():  # magnitudes in [0.5, 1.5): no FP8 subnormals (see the bound)
        full.weight.copy_((torch.rand(96, 64) + 0.5) * torch.randn(96, 64).sign() / 8)
    x = (torch.rand(2, 32, 64) + 0.5) * torch.randn(2, 32, 64).sign()
    g = (torch.rand(2, 32, 96) + 0.5) * torch.randn(2, 32, 96).sign()
    if style == "row":
        full = torch.nn.Linear(96, 64, bias=False)
        with torch.no_grad():
            full.weight.copy_((torch.rand(64, 96) + 0.5) * torch.randn(64, 96).sign() / 8)
        x, g = g, x
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    layer = cls.from_linear(full, group, rank, world_size, sequence_parallel=sequence_parallel)
    layer.weight.fp8_format = "hybrid"

    # with SP a rank holds a block of the 64 tokens (mega.parallel.tensor.mappings), [2, 16, h]
    def block(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(64, -1)[rank * 32 : (rank + 1) * 32].reshape(2, 16, -1)

    local_x = x.clone()
    if style == "row":  # the input's columns of this rank; with SP the output's tokens
        local_x = x[..., rank * 48 : (rank + 1) * 48].clone()
    elif sequence_parallel:
        local_x = block(x).clone()
    local_x.requires_grad_()
    out = layer(local_x)
    local_g = block(g) if sequence_parallel and style == "row" else g
    if style == "column":
        local_g = g[..., rank * 48 : (rank + 1) * 48]
    out.backward(local_g.contiguous())
    return {"x": x, "g": g, "w": full.weight.detach(), "out": out.detach(),
            "x_grad": local_x.grad, "w_grad": layer.weight.grad}  # fmt: skip


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("style", ["column", "row"])
def test_tensor_parallel_fp8_linears_are_within_the_fp8_bound(style, sequence_parallel):
    """Each TP rank casts its own shard with its own scale, so TP=2 is not bitwise one process;
    every rank's output and gradients must still be the exact (float64) product of the full
    tensors' pieces within the FP8 rounding bound, sums over ranks adding their bounds."""
    from mega.testing.ranks import run_ranks

    ranks = run_ranks(_tp_linear_rank, 2, style, sequence_parallel)
    u4, u5 = ROUNDOFF[E4M3], ROUNDOFF[E5M2]
    for rank, r in enumerate(ranks):
        x, g, w = (r[k].double().reshape(-1, r[k].shape[-1]) if r[k].ndim == 3 else r[k].double()
                   for k in ("x", "g", "w"))  # fmt: skip
        cols, rows = slice(rank * 48, (rank + 1) * 48), slice(rank * 32, (rank + 1) * 32)
        if style == "column":
            w_local, g_local = w[cols], g[:, cols]
            out = (x @ w_local.t(), product_error_bound(x, w_local.t(), u4, u4))
            w_grad = (g_local.t() @ x, product_error_bound(g_local.t(), x, u5, u4))
            # the input gradient is summed over the ranks (this rank's tokens of it with SP)
            x_grad = (g @ w, product_error_bound(g, w, u5, u4))
            if sequence_parallel:
                x_grad = (x_grad[0][rows], x_grad[1][rows])
        else:
            x_local, w_local = x[:, cols], w[:, cols]
            out = (x @ w.t(), product_error_bound(x, w.t(), u4, u4))  # summed over the ranks
            if sequence_parallel:
                out = (out[0][rows], out[1][rows])
            # (with SP, backward gathers the output gradient's tokens back: all of g)
            x_grad = (g @ w_local, product_error_bound(g, w_local, u5, u4))
            w_grad = (g.t() @ x_local, product_error_bound(g.t(), x_local, u5, u4))
        got = {"out": r["out"], "x_grad": r["x_grad"], "w_grad": r["w_grad"]}
        for name, (exact, bound) in {"out": out, "x_grad": x_grad, "w_grad": w_grad}.items():
            value = got[name].double().reshape(exact.shape)
            assert ((value - exact).abs() <= bound * 1.001 + 1e-5).all(), (rank, name)


def _first_steps(args: list[str], tmp_path) -> tuple[list[dict], list[str]]:
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine

    plugins = make_plugins()
    config = resolve_config([*args, "--run-dir", str(tmp_path)], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    import json

    rows = [json.loads(line) for line in lines if "lm_loss" in line]
    fp8 = [n for n, p in engine.model.named_parameters() if getattr(p, "fp8_format", None)]
    return rows, fp8


@pytest.mark.parametrize("model", ["bert", "t5", "t5-relative", "moe"])
def test_fp8_reaches_every_builtin_models_layers(fp8_on_cpu, tmp_path, model):
    """The plan-driven marking on BERT (one layer list), T5 (encoder and decoder lists, cross
    attention; learned or relative positions) and a MoE GPT (attention only: the experts stay
    bf16): the layers' linears run FP8 and the first step's loss is the bf16 one's within the
    GPU test's 2% (the same weights and batch; FP8 only rounds the GEMM operands). The first
    backward's gradient norm too, within one FP8 GEMM's worst case relative to its operands'
    magnitudes (u_e4m3 + u_e5m2 + their product, 0.195): a wrong or unscaled backward is off by
    far more."""
    from test_bert_t5_parallel import BERT, T5, T5_HF
    from test_moe_parallel import MOE

    args = {"bert": BERT, "t5": T5, "t5-relative": T5_HF, "moe": MOE}[model]
    args = [*args, "--bf16", "--device", "cpu", "--train-iters", "1"]
    (bf16,), _ = _first_steps(args, tmp_path / "bf16")
    (fp8,), marked = _first_steps([*args, "--fp8-format", "hybrid"], tmp_path / "fp8")
    assert marked and all(".layers." in name and name.endswith("weight") for name in marked)
    assert not any("experts" in name or "router" in name for name in marked)
    assert fp8["lm_loss"] == pytest.approx(bf16["lm_loss"], rel=0.02)
    assert fp8["lm_loss"] != bf16["lm_loss"]
    worst = ROUNDOFF[E4M3] + ROUNDOFF[E5M2] + ROUNDOFF[E4M3] * ROUNDOFF[E5M2]
    assert fp8["grad_norm"] == pytest.approx(bf16["grad_norm"], rel=worst)


@pytest.mark.parametrize(
    ("gpus", "refused"),
    [([(8, 0)], True), ([(8, 0), (7, 5)], True), ([(9, 0), (7, 5)], False), ([(8, 9)], False)],
)
def test_a_machine_without_fp8_tensor_cores_is_refused_before_launch(monkeypatch, gpus, refused):
    """Pre-Ada GPUs (an A100 is 8.0) are refused from NVML's list, with no CUDA context; a
    machine with one capable GPU is left to the ranks, which check the GPU they get."""
    from mega.parallel.fp8 import checks

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(checks, "nvml_capabilities", lambda: gpus)
    problems = checks.fp8_device_problems("--fp8-format hybrid", "cuda")
    assert bool(problems) == refused
    if refused:
        newest = ".".join(map(str, max(gpus)))
        assert problems == [
            "--fp8-format hybrid needs FP8 tensor cores (compute capability 8.9 or newer: Ada,"
            f" Hopper); this machine's newest GPU is {newest}"
        ]
