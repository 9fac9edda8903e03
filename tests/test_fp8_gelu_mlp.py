"""The fused FP8 GeLU MLP (``mega.parallel.fp8.mlp``) on the CPU, where its cast sites run as the
eager reference ops: bit for bit the two FP8 linears around ``F.gelu`` it replaces, forward and
every gradient, through the GPT MLP module too, with gradient accumulation fusion and under
tensor (and sequence) parallelism. The Triton kernels against the reference: test_gpu_fp8.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fp8 import enforce_cuda_rules, scaled_mm_with_cuda_rules  # noqa: F401

from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.fp8.linear import fp8_linear
from mega.parallel.fp8.mlp import fp8_gelu_mlp, fuses_gelu_mlp
from mega.parallel.topology import Topology


def _operands(fc1_bias: bool, fc2_bias: bool, hidden: int = 64, ffn: int = 96):
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(2, 16, hidden, dtype=bf16, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(ffn, hidden, dtype=bf16) / 8)
    b1 = torch.nn.Parameter(torch.randn(ffn, dtype=bf16)) if fc1_bias else None
    w2 = torch.nn.Parameter(torch.randn(hidden, ffn, dtype=bf16) / 8)
    b2 = torch.nn.Parameter(torch.randn(hidden, dtype=bf16)) if fc2_bias else None
    grad = torch.randn(2, 16, hidden, dtype=bf16)
    return x, w1, b1, w2, b2, grad


def _gradients(out: torch.Tensor, grad: torch.Tensor, *tensors) -> list:
    out.backward(grad)
    found = [None if t is None else t.grad.clone() for t in tensors]
    for t in tensors:
        if t is not None:
            t.grad = None
    return found


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize(("fc1_bias", "fc2_bias"), [(True, True), (False, False), (True, False)])
def test_the_fused_mlp_is_the_two_fp8_linears_bit_for_bit(fp8_format, fc1_bias, fc2_bias):
    x, w1, b1, w2, b2, grad = _operands(fc1_bias, fc2_bias)
    w1.fp8_format = w2.fp8_format = fp8_format
    tensors = (x, w1, b1, w2, b2)

    hidden = F.gelu(fp8_linear(x, w1, b1, fp8_format, fuse_wgrad=False))
    unfused = fp8_linear(hidden, w2, b2, fp8_format, fuse_wgrad=False)
    expected = _gradients(unfused, grad, *tensors)

    fused = fp8_gelu_mlp(x, w1, b1, w2, fc2_bias_follows=b2 is not None)
    fused = fused if b2 is None else fused + b2
    got = _gradients(fused, grad, *tensors)

    assert torch.equal(fused, unfused)
    for name, want, have in zip(("x", "w1", "b1", "w2", "b2"), expected, got, strict=True):
        assert (want is None) == (have is None), name
        if want is not None:
            assert torch.equal(have, want), name


def _gpt_mlp():
    from mega.core.config.resolve import resolve_config
    from mega.core.plugins.manager import make_plugins
    from mega.plugins.models.common.mlp import MLP

    from conftest import TINY

    args = [*TINY, "--num-layers", "1"]
    config = resolve_config(args, make_plugins())
    torch.manual_seed(0)
    return MLP(config.model).to(torch.bfloat16)


def _unfused(mlp, hidden: torch.Tensor) -> torch.Tensor:
    """What the MLP computed before the fusion: each linear's own forward (each an FP8 linear)."""
    return mlp.linear_fc2(F.gelu(mlp.linear_fc1(hidden)))


def test_the_gpt_mlp_takes_the_fused_path_only_for_fp8_gelu():
    mlp = _gpt_mlp()
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    assert not fuses_gelu_mlp(mlp.activation_name, fc1, fc2)  # bf16
    fc1.fp8_format = fc2.fp8_format = "hybrid"
    assert fuses_gelu_mlp("gelu", fc1, fc2)
    assert not fuses_gelu_mlp("gelu_tanh", fc1, fc2) and not fuses_gelu_mlp("relu", fc1, fc2)
    fc2.fp8_format = "e4m3"  # both linears must share one format
    assert not fuses_gelu_mlp("gelu", fc1, fc2)


def test_the_gpt_mlp_fuses_its_fp8_weight_gradients_into_main_grad(monkeypatch):
    """The module's path (FC2's bias added after, as ``Linear.reduce_output`` does) with
    gradient accumulation fusion over two steps of three micro-batches: ``main_grad`` (written,
    then accumulated) is the unfused linears' exactly, and the fused function ran."""
    import mega.plugins.models.common.mlp as mlp_module

    calls = []
    real = mlp_module.fp8_gelu_mlp
    monkeypatch.setattr(mlp_module, "fp8_gelu_mlp", lambda *a: calls.append(1) or real(*a))
    hidden = _gpt_mlp().linear_fc1.in_features
    torch.manual_seed(1)
    batches = [torch.randn(2, 16, hidden, dtype=torch.bfloat16) for _ in range(3)]
    grads = []
    for forward in (lambda m, t: m(t), _unfused):
        mlp = _gpt_mlp()
        buffer = ParamAndGradBuffer.build(mlp, Topology())
        for linear in (mlp.linear_fc1, mlp.linear_fc2):
            linear.weight.fp8_format, linear.weight.fuse_wgrad = "hybrid", True
        for _ in range(2):  # the second step must start from its own first micro-batch
            buffer.start_step(len(batches))
            for batch in batches:
                forward(mlp, batch).float().sum().backward()
            buffer.finish_grad_sync()
        grads.append({name: p.main_grad for name, p in mlp.named_parameters()})
    assert len(calls) == 6
    for name, want in grads[1].items():
        assert torch.equal(grads[0][name], want), name


def _tp_mlp_rank(rank, world_size, sequence_parallel):
    import torch.distributed as dist

    from mega.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
    from mega.parallel.topology import build_topology

    enforce_cuda_rules()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = build_topology(world_size, rank, tp=world_size).group("tp")
    mlp = _gpt_mlp()  # the same full weights on every rank
    kwargs = {"sequence_parallel": sequence_parallel}
    mlp.linear_fc1 = ColumnParallelLinear.from_linear(mlp.linear_fc1, group, rank, 2, **kwargs)
    mlp.linear_fc2 = RowParallelLinear.from_linear(mlp.linear_fc2, group, rank, 2, **kwargs)
    for linear in (mlp.linear_fc1, mlp.linear_fc2):
        linear.weight.fp8_format = "hybrid"
    torch.manual_seed(2)
    hidden = mlp.linear_fc2.weight.shape[0]
    x = torch.randn(2, 32, hidden, dtype=torch.bfloat16)
    if sequence_parallel:  # this rank's block of the 64 tokens (mega.parallel.tensor.mappings)
        x = x.reshape(64, hidden)[rank * 32 : (rank + 1) * 32].reshape(2, 16, hidden)
    results = []
    for forward in (mlp, lambda t: _unfused(mlp, t)):
        x_local = x.clone().requires_grad_()
        out = forward(x_local)
        out.float().square().sum().backward()
        results.append([out.detach(), x_local.grad] + [p.grad for p in mlp.parameters()])
        mlp.zero_grad(set_to_none=True)
    return results


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_the_fused_mlp_under_tensor_parallelism_is_its_linears_bit_for_bit(sequence_parallel):
    """FC1 column-parallel (input gathered by ``gather_input``), FC2 row-parallel (partial
    product reduced by ``reduce_output``): each rank's output and gradients are those of the
    unfused column and row linears."""
    from mega.testing.ranks import run_ranks

    for rank, (fused, unfused) in enumerate(run_ranks(_tp_mlp_rank, 2, sequence_parallel)):
        assert len(fused) == len(unfused) == 6
        for i, (have, want) in enumerate(zip(fused, unfused, strict=True)):
            assert torch.equal(have, want), (rank, i)
