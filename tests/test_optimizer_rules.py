"""Optimizer update rules (``--optimizer``, ``register_optimizers``) and Megatron's precision-aware
optimizer (``--use-precision-aware-optimizer`` with bf16/fp16 moments)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mega import OptimizerSpec, hookimpl
from mega.core.config.sections import OptimizerConfig, PrecisionConfig
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.data.optimizer import FlatOptimizer
from mega.parallel.topology import Topology
from mega.testing import TINY_GPT, train_losses

RUN = [*TINY_GPT, "--train-iters", "10", "--hidden-dropout", "0", "--attention-dropout", "0"]
BF16_MOMENTS = [
    "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
]  # fmt: skip


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _steps(optimizer: FlatOptimizer, model: torch.nn.Module, buffer: Any, on_grads: Any) -> None:
    """Three steps at lr 1e-2; ``on_grads(iteration)`` sees each step's gradients first."""
    torch.manual_seed(2)
    for iteration in (1, 2, 3):
        buffer.start_step(1)
        dtype = next(model.parameters()).dtype
        model(torch.randn(4, 8, dtype=dtype)).float().square().sum().backward()
        buffer.finish_grad_sync()
        on_grads(iteration)
        optimizer.step(1e-2, iteration)


def test_bf16_moments_are_fp32_adamw_with_its_stored_moments_rounded():
    """The update computes in fp32 and rounds only what it stores: the masters equal fp32
    AdamW fed the bf16-rounded moments of the previous step, and the state takes 2 + 2 bytes a
    parameter instead of 4 + 4 (plus the 4 of the fp32 master, for a bf16 model)."""
    model = _mlp().to(torch.bfloat16)
    buffer = ParamAndGradBuffer.build(model, Topology())
    optim = OptimizerConfig(
        clip_grad=0.0, use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
        exp_avg_sq_dtype="bf16",
    )  # fmt: skip
    optimizer = FlatOptimizer(buffer, optim, PrecisionConfig(bf16=True))
    assert {t.dtype for t in optimizer.states.values()} == {torch.bfloat16}
    assert optimizer.state_bytes() == optimizer.elements * (2 + 2 + 4)
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    m = [torch.zeros_like(w) for w in master]
    v = [torch.zeros_like(w) for w in master]
    b1, b2, eps, lr = optim.adam_beta1, optim.adam_beta2, optim.adam_eps, 1e-2

    def reference(step: int) -> None:  # the formulas of adamw_flat_, moments stored in bf16
        for i, p in enumerate(params):
            g, decay = p.main_grad.float(), optim.weight_decay if p.ndim >= 2 else 0.0
            new_m, new_v = b1 * m[i] + (1 - b1) * g, b2 * v[i] + (1 - b2) * g * g
            denom = new_v.sqrt() / (1 - b2**step) ** 0.5 + eps
            master[i] = master[i] - lr * decay * master[i] - lr / (1 - b1**step) * new_m / denom
            m[i], v[i] = new_m.bfloat16().float(), new_v.bfloat16().float()

    _steps(optimizer, model, buffer, reference)
    for p, expected in zip(params, master, strict=True):
        # the same fp32 formula in another order: fp32 rounding apart
        torch.testing.assert_close(optimizer.master_of(p).view_as(p), expected)


def test_bf16_moments_train_within_their_rounding_of_the_fp32_run(tmp_path: Path):
    """Each update differs from the fp32 run's by at most about bf16's relative precision
    (2**-8: a moment rounded at 2**-9, the second moment's square root halving its error), so
    the losses differ by at most that share of what the updates moved the loss; 2**-7 leaves a
    factor of 2 for the moments' histories drifting apart."""
    fp32 = train_losses(RUN, tmp_path / "fp32")
    bf16 = train_losses([*RUN, *BF16_MOMENTS], tmp_path / "bf16")
    moved = abs(fp32[0] - fp32[-1])
    assert moved > 0.01  # the run trains
    for a, b in zip(bf16, fp32, strict=True):
        assert abs(a - b) <= 2**-7 * moved, (bf16, fp32)
    assert bf16 != fp32  # the moments were kept in bf16


def test_a_checkpoint_resumes_with_other_moment_dtypes(mega_cli, tmp_path: Path):
    """Checkpoints store the moments in the dtype they were kept in; a load casts them, so a
    run resumes with or without --use-precision-aware-optimizer."""
    args = [*TINY_GPT, "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-decay-iters", "6"]
    saved = mega_cli(["train", *args, *BF16_MOMENTS, "--train-iters", "3",
                      "--save", str(tmp_path / "c"), "--run-dir", str(tmp_path / "a")])  # fmt: skip
    assert saved.exit_code == 0, saved.stderr
    resumed = mega_cli(["train", *args, "--train-iters", "5", "--load", str(tmp_path / "c"),
                        "--save", str(tmp_path / "d"), "--run-dir", str(tmp_path / "b")])  # fmt: skip
    assert resumed.exit_code == 0, resumed.stderr
    back = mega_cli(["train", *args, *BF16_MOMENTS, "--train-iters", "6", "--load",
                     str(tmp_path / "d"), "--run-dir", str(tmp_path / "e")])  # fmt: skip
    assert back.exit_code == 0, back.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], "fp8 moments are not built"),
        (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], "main gradients in fp32 only"),
        (["--optimizer", "sgd", *BF16_MOMENTS], "--optimizer sgd keeps no exp_avg"),
        (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    ],
)  # fmt: skip
def test_what_the_optimizer_cannot_do_is_one_error_line(mega_cli, flags: list[str], message: str):
    result = mega_cli(["train", *TINY_GPT, "--train-iters", "1", *flags])
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("error:") and message in line for line in lines), lines
    assert "Traceback" not in result.stderr


# A third party's rule: Lion (Chen et al., 2023), element-wise, one state. One file and one
# registration: docs/plugins.md shows the same.
def lion_flat_(
    master, grad, states, lowp, *, lr, weight_decay, step, grad_scale, skip, beta1, beta2
):  # noqa: ANN001, ANN201, ARG001
    (exp_avg,) = states
    g = grad / grad_scale
    direction = torch.sign(beta1 * exp_avg.float() + (1.0 - beta1) * g)
    new_master = torch.where(skip, master, master * (1.0 - lr * weight_decay) - lr * direction)
    exp_avg.copy_(torch.where(skip, exp_avg.float(), beta2 * exp_avg.float() + (1.0 - beta2) * g))
    master.copy_(new_master)
    if lowp is not None:
        lowp.copy_(new_master)


LION = OptimizerSpec(
    name="lion",
    build=lambda: lion_flat_,
    states=("exp_avg",),
    hyperparameters=lambda o: {"beta1": o.adam_beta1, "beta2": o.adam_beta2},
    description="Lion: the sign of an interpolated momentum",
)


class LionPlugin:
    @hookimpl
    def register_optimizers(self, register: Any) -> None:
        register(LION)


def test_a_plugin_rule_updates_by_its_own_formula():
    model = _mlp()
    buffer = ParamAndGradBuffer.build(model, Topology())
    optimizer = FlatOptimizer(buffer, OptimizerConfig(clip_grad=0.0, weight_decay=0.0),
                              PrecisionConfig(), LION)  # fmt: skip
    assert set(optimizer.flat_states()) == {"exp_avg"}
    before = [p.detach().clone() for p in model.parameters()]
    buffer.start_step(1)
    model(torch.randn(4, 8)).square().sum().backward()
    buffer.finish_grad_sync()
    grads = [p.main_grad.clone() for p in model.parameters()]
    optimizer.step(1e-2, 1)
    # Lion's first step: its momentum starts at 0, so each weight moves by lr times the sign of
    # its gradient
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - 1e-2 * torch.sign(g))


def test_a_plugin_rule_trains_and_checkpoints_its_states(mega_cli, tmp_path: Path):
    args = [*TINY_GPT, "--optimizer", "lion", "--lr", "1e-4", "--train-iters", "3"]
    done = mega_cli(["train", *args, "--save", str(tmp_path / "c"), "--run-dir", str(tmp_path / "a")], LionPlugin())  # fmt: skip
    assert done.exit_code == 0, done.stderr
    names = {p.name for p in (tmp_path / "c").rglob("*") if p.is_dir()}
    assert "exp_avg" in names and "exp_avg_sq" not in names
    unknown = mega_cli(["train", *TINY_GPT, "--optimizer", "lino"], LionPlugin())
    assert unknown.exit_code == 2 and "lion" in unknown.stderr  # the did-you-mean names it


def test_the_old_class_name_warns():
    import mega.parallel.data.optimizer as module

    with pytest.warns(DeprecationWarning, match="use FlatOptimizer"):
        assert module.MixedPrecisionAdamW is FlatOptimizer
