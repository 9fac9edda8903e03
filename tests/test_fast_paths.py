"""The speed features change no number: gradient accumulation fusion, the gradient buffer's
overwrite-on-first-gradient (no zeroing between steps), clipping folded into the AdamW update,
``--compile`` and ``--attention-backend``. Each is checked against the plain path on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mega.core.config.resolve import resolve_config
from mega.core.console.display import Display
from mega.core.plugins.manager import make_plugins
from mega.core.training.engine import Engine
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.linear import Linear
from mega.parallel.topology import Topology
from mega.parallel.weight_grad import deferring_weight_grads
from mega.testing import train_losses

from conftest import TINY


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Linear(8, 16), nn.GELU(), Linear(16, 4, bias=False), nn.LayerNorm(4))


def _autograd_grads(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain autograd: the gradients summed over ``batches``."""
    model.zero_grad()
    for x in batches:
        model(x).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fuse", [True, False])
def test_buffer_gradients_equal_autograd_and_each_step_starts_fresh(fuse: bool):
    reference, model = _mlp(), _mlp()
    buffer = ParamAndGradBuffer.build(model, Topology())
    for param in buffer.params:
        param.fuse_wgrad = fuse
    torch.manual_seed(1)
    steps = [[torch.randn(5, 3, 8) for _ in range(3)] for _ in range(2)]
    for batches in steps:  # step 2 must not see step 1's gradients: nothing zeroes the buffer
        buffer.start_step(len(batches))
        for x in batches:
            model(x).square().sum().backward()
        buffer.finish_grad_sync()
        expected = _autograd_grads(reference, batches)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-5, atol=1e-6)
            assert param.grad is None


def test_a_parameter_without_gradient_this_step_reads_zero():
    model = _mlp()
    buffer = ParamAndGradBuffer.build(model, Topology())
    for param in buffer.params:
        param.fuse_wgrad = True
    buffer.start_step(1)
    model(torch.randn(2, 8)).sum().backward()
    buffer.finish_grad_sync()
    buffer.start_step(1)  # this step skips the last layer (its norm) entirely
    model[:3](torch.randn(2, 8)).sum().backward()
    buffer.finish_grad_sync()
    assert model[3].weight.main_grad.abs().sum() == 0
    assert model[0].weight.main_grad.abs().sum() > 0


def test_fused_weight_gradient_of_bf16_linear_is_accumulated_in_fp32():
    torch.manual_seed(0)
    layer = Linear(64, 32).to(torch.bfloat16)
    buffer = ParamAndGradBuffer.build(layer, Topology())
    layer.weight.fuse_wgrad = True
    xs = [torch.randn(16, 64, dtype=torch.bfloat16) for _ in range(4)]
    buffer.start_step(len(xs))
    for x in xs:
        layer(x).float().sum().backward()
    buffer.finish_grad_sync()
    # d(sum)/dW = sum over tokens of x: the exact fp32 sum of the bf16 inputs
    expected = torch.stack([x.float().sum(0) for x in xs]).sum(0).expand(32, 64)
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-6, atol=1e-5)


RUN = [*TINY, "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize(
    "variant",
    [["--no-gradient-accumulation-fusion"], ["--compile"], ["--attention-backend", "unfused"]],
    ids=lambda v: v[-1].lstrip("-"),
)
def test_a_fast_path_trains_like_the_plain_one(variant: list[str], tmp_path: Path):
    base = train_losses(RUN, tmp_path / "base")
    other = train_losses([*RUN, *variant], tmp_path / "other")
    torch.testing.assert_close(other, base, rtol=1e-5, atol=0)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_clipping_folded_into_adamw_matches_clip_then_step(clip: float):
    """FlatOptimizer (the clip factor folded into the update) against
    ``clip_grad_norm_`` followed by ``torch.optim.AdamW``, over three steps."""
    from mega.core.config.sections import OptimizerConfig, PrecisionConfig
    from mega.parallel.data.optimizer import FlatOptimizer

    model, reference = _mlp(), _mlp()
    buffer = ParamAndGradBuffer.build(model, Topology())
    optimizer = FlatOptimizer(buffer, OptimizerConfig(clip_grad=clip), PrecisionConfig())
    params = list(reference.parameters())
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        fused=True,
    )
    torch.manual_seed(2)
    for iteration in (1, 2, 3):
        x = torch.randn(4, 8)
        buffer.start_step(1)
        model(x).square().sum().backward()
        buffer.finish_grad_sync()
        # the reference gets the same gradients: only clipping and the update are compared
        for param, ref in zip(model.parameters(), params, strict=True):
            ref.grad = param.main_grad.clone()
        norm = optimizer.step(1e-2, iteration).grad_norm
        expected = torch.nn.utils.clip_grad_norm_(params, clip) if clip else None
        if expected is not None:
            assert norm > 2 * clip  # the clip acts
            torch.testing.assert_close(norm, expected)
        adam.step()
        for got, want in zip(model.parameters(), params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_non_finite_gradients_skip_the_update_on_the_device():
    from mega.core.config.sections import OptimizerConfig, PrecisionConfig
    from mega.parallel.data.optimizer import FlatOptimizer

    model = _mlp()
    buffer = ParamAndGradBuffer.build(model, Topology())
    optimizer = FlatOptimizer(buffer, OptimizerConfig(), PrecisionConfig())
    before = [p.detach().clone() for p in model.parameters()]
    buffer.start_step(1)
    (model(torch.randn(4, 8)).sum() * float("nan")).backward()
    buffer.finish_grad_sync()
    assert optimizer.first_nonfinite() is None
    optimizer.step(1e-2)  # a caller that passes no iteration still gets the step reported
    assert optimizer.first_nonfinite()[0] == 0
    for got, want in zip(model.parameters(), before, strict=True):
        assert torch.equal(got, want)


def test_fused_attention_on_the_cpu_is_a_usage_error(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "mega", "train", *RUN, "--attention-backend", "fused",
         "--device", "cpu", "--run-dir", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--attention-backend fused" in proc.stderr and "CUDA" in proc.stderr


def test_compile_is_on_by_default_on_gpus_in_every_layout():
    """Tensor- and expert-parallel layers compile (functional collectives), context-parallel
    ones around their attention (opaque custom ops); on a CPU only when asked."""
    from mega.core.training.build import compiles_layers

    cuda = torch.device("cuda")
    assert compiles_layers(None, cuda)
    assert not compiles_layers(False, cuda)
    assert not compiles_layers(None, torch.device("cpu"))
    assert compiles_layers(True, torch.device("cpu"))
    for flags in (["--tensor-model-parallel-size", "2"], ["--expert-model-parallel-size", "2"]):
        model = (
            ["--model", "moe", *RUN[2:], "--num-experts", "4"] if "--expert" in flags[0] else RUN
        )
        config = resolve_config(
            [*model, *flags, "--nproc-per-node", "2", "--compile"], make_plugins()
        )
        assert config.training.compile


def test_a_finished_engine_frees_its_parameters(tmp_path: Path):
    """Nothing keeps a run's model alive once its engine is dropped (several runs in one
    process, e.g. a benchmark or a notebook, must not pile up GPU memory)."""
    import gc
    import weakref

    plugins = make_plugins()
    engine = Engine(
        resolve_config([*RUN, "--run-dir", str(tmp_path)], plugins),
        plugins,
        Display(rich_output=False),
    )
    engine.train()
    param = weakref.ref(next(engine.model.parameters()))
    grads = weakref.ref(engine.buffer.main_grad)
    del engine
    gc.collect()
    assert param() is None and grads() is None


def test_deferred_weight_gradients_wait_for_the_queue_then_equal_autograd():
    """The zero-bubble schedules' split backward: inside ``deferring_weight_grads`` the fused
    weights' GEMMs are queued (their main_grad untouched, their bucket not ready for overlapped
    reduction); running the queue gives autograd's gradients and reports them to the buffer."""
    reference, model = _mlp(), _mlp()
    buffer = ParamAndGradBuffer.build(model, Topology(), overlap=True, bucket_size=1)
    for param in buffer.params:
        param.fuse_wgrad = True
    weights = [model[0].weight, model[2].weight]
    torch.manual_seed(1)
    batches = [torch.randn(5, 3, 8) for _ in range(2)]
    buffer.start_step(len(batches))
    queues = []
    for x in batches:
        with deferring_weight_grads() as queue:
            model(x).square().sum().backward()
        queues.append(queue)
    assert [len(q) for q in queues] == [2, 2]  # both linears' weights, per micro-batch
    assert all(w.main_grad_fresh for w in weights)  # nothing written yet
    assert not any(buffer.bucket_of[w].started for w in weights)
    assert buffer.bucket_of[model[0].bias].waiting == 0  # not deferred: counted in backward
    for queue in queues:
        queue.run()
    assert all(buffer.bucket_of[w].started for w in weights)
    buffer.finish_grad_sync()
    expected = _autograd_grads(reference, batches)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-5, atol=1e-6)


def _gpt_layer_with_buffer(compiled: bool) -> tuple[nn.Module, ParamAndGradBuffer]:
    from mega.plugins.models.common.config import GPTConfig
    from mega.plugins.models.common.layers import TransformerLayer

    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    torch.manual_seed(0)
    layer = TransformerLayer(cfg)
    for param in layer.parameters():
        nn.init.normal_(param, std=0.1)
    buffer = ParamAndGradBuffer.build(layer, Topology())
    for param in buffer.params:
        param.fuse_wgrad = True
    if compiled:
        torch._dynamo.reset()
        layer.compile()
    return layer, buffer


def test_a_compiled_layer_with_fused_linears_is_one_graph_with_the_same_gradients():
    """The fused weight gradient is a custom op, not a compiler-disabled call: a compiled
    transformer layer traces without a graph break (each break cost about 250 us of host time per
    linear on an H100), and its gradients, bias gradients included, equal eager ones."""
    from torch._dynamo.utils import counters

    grads = []
    for compiled in (False, True):
        layer, buffer = _gpt_layer_with_buffer(compiled)
        counters.clear()
        torch.manual_seed(1)
        for _ in range(2):  # the second step overwrites the first (beta 0), then accumulates
            buffer.start_step(2)
            for _ in range(2):
                layer(torch.randn(2, 8, 32)).square().sum().backward()
            buffer.finish_grad_sync()
        grads.append(buffer.main_grad.clone())
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
    assert grads[0].abs().sum() > 0


def test_a_compiled_layer_defers_its_weight_gradients_at_run_time():
    """The zero-bubble split inside a compiled backward: the op checks for a queue when it runs,
    not when it was traced, so one compiled graph serves both the deferred and the plain step."""
    eager, eager_buffer = _gpt_layer_with_buffer(compiled=False)
    layer, buffer = _gpt_layer_with_buffer(compiled=True)
    x = torch.randn(2, 8, 32)
    for model, buf in ((eager, eager_buffer), (layer, buffer)):
        buf.start_step(2)
        model(x).square().sum().backward()  # a plain backward first: traces the graph
    with deferring_weight_grads() as queue:
        layer(x + 1).square().sum().backward()
    weights = [p for p in buffer.params if p.ndim == 2]
    assert len(queue) == len(weights) == 4
    before = [w.main_grad.clone() for w in weights]
    assert not any(getattr(w, "grad_added_to_main_grad", False) for w in weights)
    queue.run()
    assert not all(torch.equal(w.main_grad, b) for w, b in zip(weights, before, strict=True))
    eager(x + 1).square().sum().backward()
    buffer.finish_grad_sync()
    eager_buffer.finish_grad_sync()
    torch.testing.assert_close(buffer.main_grad, eager_buffer.main_grad, rtol=1e-5, atol=1e-5)


def test_flat_adamw_on_bf16_parameters_matches_torch_adamw_on_fp32_masters():
    """bf16 parameters: the flat update of the fp32 masters equals torch.optim.AdamW on fp32
    copies given the same gradients, and the bf16 parameters are those masters rounded."""
    from mega.core.config.sections import OptimizerConfig, PrecisionConfig
    from mega.parallel.data.optimizer import FlatOptimizer

    model = _mlp().to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    buffer = ParamAndGradBuffer.build(model, Topology())
    optim = OptimizerConfig(clip_grad=0.0, weight_decay=0.1)
    optimizer = FlatOptimizer(buffer, optim, PrecisionConfig(bf16=True))
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in reference if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in reference if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    torch.manual_seed(2)
    for iteration in (1, 2, 3):
        buffer.start_step(1)
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().sum().backward()
        buffer.finish_grad_sync()
        for param, ref in zip(model.parameters(), reference, strict=True):
            ref.grad = param.main_grad.clone()
        optimizer.step(1e-2, iteration)
        adam.step()
        for param, ref in zip(model.parameters(), reference, strict=True):
            master = optimizer.master_of(param).view_as(ref)
            torch.testing.assert_close(master, ref.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(param, master.to(torch.bfloat16))


def test_the_fp8_kernels_load_only_when_a_model_is_marked_for_fp8():
    """The FP8 casts' Triton kernels register through ``torch.library.triton_op``, which imports
    ``torch._inductor`` and ``torch._dynamo``. Loaded at import, on a CUDA build with Triton (the
    GPU machines' torch 2.11), they made every command pay that, and the test above failed
    there. Here, as a CUDA build would, importing the layers never asks for the kernels' module;
    marking a model for FP8 does."""
    code = (
        "import sys, torch\n"
        "torch.version.cuda = '13.0'  # as a CUDA build: the loader looks for the kernels\n"
        "asked = []\n"
        "class Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        asked.append(name)\n"
        "sys.meta_path.insert(0, Finder())\n"
        "import mega.parallel.linear, mega.plugins.models.gpt, mega.parallel.fp8.apply\n"
        "print('asked at import:', 'mega.parallel.fp8.gelu_kernels' in asked)\n"
        "from mega.parallel.fp8 import weight_cast\n"
        "weight_cast.load_kernels()\n"
        "print('asked when marking:', 'mega.parallel.fp8.gelu_kernels' in asked)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "asked at import: False" in result.stdout, result.stdout
    assert "asked when marking: True" in result.stdout, result.stdout


@pytest.mark.parametrize("model", ["gpt", "bert", "t5"])
def test_an_eager_cpu_run_never_imports_dynamo(tmp_path: Path, model: str):
    """Importing ``torch._dynamo`` takes seconds (3 s of a 1-layer GPT's 9.9 s ``mega train`` on
    a 2-core machine): a run that compiles nothing must not pay it. It used to, through the
    default initialisers on meta tensors and the fused weight-gradient custom op's first call."""
    flags = {
        "gpt": TINY,
        "bert": ["--model", "bert", "--num-layers", "1", "--hidden-size", "32",
                 "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "2", "--eval-iters", "0"],
        "t5": ["--model", "t5", "--encoder-num-layers", "1", "--decoder-num-layers", "1",
               "--hidden-size", "32", "--num-attention-heads", "2", "--kv-channels", "16",
               "--ffn-hidden-size", "64", "--seq-length", "32", "--decoder-seq-length", "16",
               "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0"],
    }[model]  # fmt: skip
    args = ["train", *flags, "--mock-data", "--train-iters", "2", "--device", "cpu"]
    args += ["--run-dir", str(tmp_path / "run")]
    code = (
        "import sys; from mega.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dynamo imported: False" in result.stdout, result.stdout[-1000:]
