"""FP8 training on a GPU with FP8 tensor cores (Hopper; skipped elsewhere): the layer against
bf16 within the formats' rounding, compiled against eager, the fused weight gradient on CUDA,
training, and an exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mega.core.config.resolve import resolve_config
from mega.core.console.display import Display
from mega.core.plugins.manager import make_plugins
from mega.core.training.engine import Engine
from mega.parallel.fp8.linear import fp8_linear

from conftest import TINY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs FP8 tensor cores",
    ),
]


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_the_fp8_layer_matches_bf16_within_the_formats_rounding(fp8_format):
    """Forward and both gradients of a 1024 -> 4096 layer on 4096 tokens, as relative Frobenius
    errors against float64. Random rounding errors add in quadrature, so a GEMM whose operands are
    rounded with unit roundoffs ua and ub is off by about sqrt((ua^2 + ub^2) / 3) (uniform
    rounding): 0.05 for e4m3 x e5m2. ua + ub (0.19) is a loose ceiling: a wrong layout or scale
    is off by O(1). bf16 (2^-8) must do better than FP8."""
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32)
    g = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = fp8_linear(x, w, None, fp8_format, fuse_wgrad=False)
    y.backward(g)
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    exact = {"output": x64 @ w64.t(), "input grad": g64 @ w64, "weight grad": g64.t() @ x64}
    got = {"output": y, "input grad": x.grad, "weight grad": w.grad}
    u4, ug = 2.0**-4, 2.0 ** (-4 if fp8_format == "e4m3" else -3)
    bounds = {"output": u4 + u4, "input grad": ug + u4, "weight grad": ug + u4}
    for name in exact:
        error = relative_error(got[name], exact[name])
        bf16 = relative_error(
            {
                "output": x @ w.t(),
                "input grad": g @ w,
                "weight grad": g.t() @ x,
            }[name].detach(),
            exact[name],
        )
        assert bf16 < error < bounds[name], (name, bf16, error)


def test_compiled_fp8_linear_is_as_accurate_as_eager():
    """Compiled, the casts fuse with their neighbours and read values that were never rounded to
    bf16 (the bias add, gelu's gradient), so some elements round to the neighbouring FP8 value:
    compiled and eager are not bitwise equal. Both must be within the same worst-case bound of
    float64, and compiled no less accurate than eager beyond a tenth of it."""
    torch.manual_seed(0)
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(768, 256, device="cuda", dtype=torch.bfloat16) / 16)
    b = torch.nn.Parameter(torch.randn(768, device="cuda", dtype=torch.bfloat16))
    g = torch.randn(2, 512, 768, device="cuda", dtype=torch.bfloat16)

    def run(fn, dtype=None):
        xi = x.to(dtype or x.dtype).clone().requires_grad_()
        wi = w.detach().to(dtype or w.dtype).requires_grad_()
        bi = b.detach().to(dtype or b.dtype).requires_grad_()
        out = fn(xi, wi, bi)
        out.backward(g.to(out.dtype))
        return out.detach(), xi.grad, wi.grad, bi.grad

    def fp8_layer(xi, wi, bi):
        return F.gelu(fp8_linear(xi, wi, bi, "hybrid", fuse_wgrad=False))

    exact = run(lambda xi, wi, bi: F.gelu(F.linear(xi, wi, bi)), torch.float64)
    eager = run(fp8_layer)
    compiled = run(torch.compile(fp8_layer, fullgraph=True))
    bound = 2.0**-4 + 2.0**-3  # e4m3 operand and e5m2 gradient; the output's two e4m3 are less
    for name, e, c, ref in zip(("output", "input grad", "weight grad", "bias grad"), eager,
                               compiled, exact, strict=True):  # fmt: skip
        eager_error, compiled_error = relative_error(e, ref), relative_error(c, ref)
        assert compiled_error < bound and compiled_error < eager_error + bound / 10, name


def test_the_fused_fp8_weight_gradient_on_cuda():
    from mega.parallel.data.grad_buffer import ParamAndGradBuffer
    from mega.parallel.linear import Linear
    from mega.parallel.topology import Topology

    torch.manual_seed(0)
    layer = Linear(256, 128, bias=False).to("cuda", torch.bfloat16)
    layer.weight.fp8_format = "hybrid"
    buffer = ParamAndGradBuffer.build(layer, Topology())
    layer.weight.fuse_wgrad = True
    xs = [torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for _ in range(2):  # the second step overwrites on its first micro-batch
        buffer.start_step(len(xs))
        for x in xs:
            layer(x).float().sum().backward()
        buffer.finish_grad_sync()
    # the same FP8 GEMMs with an fp32 result, summed in fp32 as the buffer does
    w = layer.weight.detach().float().requires_grad_()
    expected = torch.zeros_like(w)
    for x in xs:
        w.grad = None
        fp8_linear(x.float(), w, None, "hybrid", fuse_wgrad=False).sum().backward()
        expected += w.grad
    # w in fp32 casts to the same FP8 values as w in bf16 (its bf16 values are exact in fp32);
    # x too; the summed gradient differs only by the order of the fp32 sums
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-5, atol=1e-4)


def fp8_code_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many representable FP8 values apart each pair of same-format elements is (the codes
    of same-sign FP8 values are ordered by magnitude)."""
    return (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("rows", "cols"), [(1000, 336), (4096, 2048)])
@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_the_gelu_cast_kernels_match_the_reference(fp8_format, rows, cols, bias, delayed):
    """The Triton passes (``mega.parallel.fp8.gelu_kernels``) against the eager ops they replace,
    on shapes that are and are not multiples of their tiles. The scales are equal (the same
    amax, the same divisions). An FP8 value may be the neighbouring one: the kernels' Φ
    (``mega.parallel.fp8.normal_tail``) is not ATen's ``0.5 * (1 + erf(x / sqrt(2)))``, which
    cancels for x < -3 (there, emulated on the CPU against float64, over a quarter of the bf16
    GeLU values differ by one ulp, the kernels' always the nearer; up to 6e-4 of the FP8
    gradients move one step); elsewhere the two agree to a float32 ulp or so and a value moves
    only at a rounding boundary (emulated: 2 of 8.4M). A wrong formula, scale or layout moves
    elements everywhere, and by more than one step. The bias gradient sums the rows in another
    order in fp32, then rounds to bf16: within one bf16 ulp. ``delayed``: the scales are given
    (below the amaxes' own, so the largest values saturate) and each site is the one-pass
    kernel; the amaxes it records are the reference's."""
    from mega.parallel.fp8 import gelu_cast
    from mega.parallel.fp8.scaling import E4M3, GRAD_DTYPES

    torch.manual_seed(0)
    y = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16) if bias else None
    grad = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) / 100
    grad_dtype = GRAD_DTYPES[fp8_format]
    assert gelu_cast.load_kernels() and gelu_cast._use_kernels(y)
    h_scale = grad_scale = None
    if delayed:  # 3/4 of the current scales: the largest values saturate
        h_scale = gelu_cast.gelu_to_fp8_reference(y, b, E4M3, None)[1] * 0.75
        reference = gelu_cast.gelu_grad_to_fp8_reference(grad, y, b, h_scale, grad_dtype, None)
        grad_scale = reference[2].reciprocal() * 0.75
    (data, scale, inverse, amax), expected = (
        gelu_cast.gelu_to_fp8(y, b, E4M3, h_scale),
        gelu_cast.gelu_to_fp8_reference(y, b, E4M3, h_scale),
    )
    assert torch.equal(scale, expected[1]) and torch.equal(inverse, expected[2])
    assert torch.equal(amax, expected[3]), "h amax"
    backward = [
        fn(grad, y, b, expected[1], grad_dtype, grad_scale)
        for fn in (gelu_cast.gelu_grad_to_fp8, gelu_cast.gelu_grad_to_fp8_reference)
    ]
    assert torch.equal(backward[0][2], backward[1][2]), "grad inverse scale"
    assert torch.equal(backward[0][5], backward[1][5]), "grad amax"
    x = y if b is None else y + b
    for name, got, want, where in [
        ("h", data, expected[0], x), ("h transposed", backward[0][4], backward[1][4], x.t()),
        ("grad", backward[0][0], backward[1][0], x),
        ("grad transposed", backward[0][1], backward[1][1], x.t()),
    ]:  # fmt: skip
        assert got.shape == want.shape and got.dtype == want.dtype, name
        steps = fp8_code_steps(got, want)
        assert steps.max() <= 1, name
        moved_where_exact = steps.bool() & (where >= -3)
        assert moved_where_exact.float().mean() < 1e-4, (name, moved_where_exact.sum())
    torch.testing.assert_close(backward[0][3], backward[1][3], rtol=2.0**-7, atol=1e-4)


@pytest.mark.parametrize(("rows", "cols"), [(1000, 336), (7680, 2560)])
def test_the_weight_cast_kernel_matches_the_reference(rows, cols):
    """``mega::weight_to_fp8`` (one pass: the cast both ways and the tiles' amaxes) against the
    eager ops, bit for bit: a product, a clamp and a rounding have one answer. The scale is below
    the amax's own, so the largest values saturate; a shape that is not a multiple of the tile
    checks the masks."""
    from mega.parallel.fp8 import weight_cast
    from mega.parallel.fp8.scaling import E4M3

    assert weight_cast.load_kernels()
    torch.manual_seed(0)
    weight = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    scale = torch.finfo(E4M3).max / weight.float().abs().amax() * 1.5
    got = weight_cast.weight_to_fp8(weight, scale)
    want = weight_cast.weight_to_fp8_reference(weight, scale)
    assert weight_cast.KERNELS is not None
    for name, a, b in [("data", got[0], want[0]), ("transposed", got[1], want[1])]:
        assert a.shape == b.shape and a.dtype == b.dtype == E4M3, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert torch.equal(got[2].amax(), want[2].amax())


RUN = [*TINY, "--device", "cuda", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _train(tmp_path: Path, *flags: str) -> list[float]:
    plugins = make_plugins()
    config = resolve_config([*RUN, "--run-dir", str(tmp_path), *flags], plugins)
    Engine(config, plugins, Display(rich_output=False)).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in rows if "lm_loss" in r]


def test_fp8_trains_about_as_well_as_bf16(tmp_path: Path):
    """30 steps of the tiny GPT: FP8 must learn; losing more than a tenth of what bf16 gains
    would mean a GEMM that is wrong rather than rounded."""
    bf16 = _train(tmp_path / "bf16", "--train-iters", "30")
    fp8 = _train(tmp_path / "fp8", "--train-iters", "30", "--fp8-format", "hybrid")
    assert fp8[0] == pytest.approx(bf16[0], rel=0.02)  # the same model, the same first batch
    assert bf16[0] - fp8[-1] >= 0.9 * (bf16[0] - bf16[-1])


def test_fp8_resumes_exactly(tmp_path: Path):
    """Tensorwise scaling keeps no state between steps: a run resumed from its checkpoint at
    step 3 repeats steps 4-6 of the uninterrupted run bit for bit."""
    flags = ["--fp8-format", "hybrid", "--train-iters", "6"]
    full = _train(tmp_path / "full", *flags)
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    _train(tmp_path / "first", *flags, *save, "--exit-interval", "3")
    resumed = _train(tmp_path / "resumed", *flags, "--load", str(tmp_path / "ckpt"))
    assert resumed[-3:] == full[-3:]


def test_delayed_fp8_trains_compiled_and_resumes_exactly(tmp_path: Path):
    """``--fp8-recipe delayed`` compiled (the amaxes are written in place from the compiled
    forward and backward): it learns as tensorwise FP8 does (within a tenth of bf16's gain,
    as above), and its histories in the checkpoint make the resume exact."""
    delayed = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--compile"]
    delayed += ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    bf16 = _train(tmp_path / "bf16", "--train-iters", "30")
    fp8 = _train(tmp_path / "delayed", "--train-iters", "30", *delayed)
    assert fp8[0] == pytest.approx(bf16[0], rel=0.02)
    assert bf16[0] - fp8[-1] >= 0.9 * (bf16[0] - bf16[-1])
    flags = [*delayed, "--train-iters", "6"]
    full = _train(tmp_path / "full", *flags)
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    _train(tmp_path / "first", *flags, *save, "--exit-interval", "3")
    resumed = _train(tmp_path / "resumed", *flags, "--load", str(tmp_path / "ckpt"))
    assert resumed[-3:] == full[-3:]
