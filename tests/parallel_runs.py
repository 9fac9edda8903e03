"""Train the same tiny GPT on N forked CPU ranks and on one, and collect what must match.

``layout_run(args, world_size)`` returns rank 0's per-iteration losses, the full (TP-gathered)
parameters after training, and each rank's optimizer-state bytes. ``losses`` is the ``lm loss``;
a model with more loss parts (BERT's ``sop loss``) has them in ``other_losses``, by metrics key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mega import hookimpl
from mega.core.config.resolve import resolve_config
from mega.core.console.display import Display
from mega.core.console.metrics import metric_key
from mega.core.plugins.manager import make_plugins
from mega.core.training.engine import Engine
from mega.testing.ranks import run_ranks

from conftest import TINY

# Dropout off: two layouts draw different dropout masks, so only dropout-free runs can match.
# Adam epsilon 1e-6, not 1e-8: Adam divides by sqrt(v) + eps, so a gradient element far below eps
# is damped and one near 1e-8 is not. With 1e-8, a near-dead FFN unit (layer 0, unit 26 of the
# 8-layer pipeline model: every gradient of fc1 row 26 / fc2 column 26 under ~1e-7) had its
# rounding noise, which TP's different summation order changes, turned into O(lr) steps: 3e-5 apart
# after 10 steps at TP=2 while all other 4078 elements of those weights stayed under 1e-6. With
# 1e-6 the same elements are 6.6e-7 apart; ordinary gradients (1e-4..1e-2) are unaffected.
# No linear biases: the key bias has an exactly-zero gradient (softmax ignores a shift shared by
# all keys), so its gradient is pure rounding noise, which Adam's m/sqrt(v) turns into O(lr)
# steps whose sign depends on summation order; measured: 3e-6 apart after 10 steps at DP=2, while
# every other parameter stays within 1e-7.
EQUIVALENCE = [
    *TINY, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--lr", "3e-3",
    "--disable-bias-linear", "--adam-eps", "1e-6",
]  # fmt: skip


class _Losses:
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        # every loss part but the lm loss ({"sop_loss": [...]} for BERT), by metrics key
        self.other_losses: dict[str, list[float]] = {}

    @hookimpl
    def step_end(self, engine: Any, iteration: int, metrics: dict[str, float]) -> None:
        if "lm_loss" in metrics:
            self.losses.append(metrics["lm_loss"])
            self.grad_norms.append(metrics["grad_norm"])
            # the model's own parts only: MoE router statistics (load_balancing_loss, z_loss)
            # are also ``*_loss`` metrics, but not what training minimises
            for name in getattr(engine, "loss_names", ("lm loss",)):
                key = metric_key(name)
                if key != "lm_loss":
                    self.other_losses.setdefault(key, []).append(metrics[key])


def full_parameters(engine: Engine) -> dict[str, torch.Tensor]:
    """Every parameter as its global fp32 tensor: gathered over tensor-parallel ranks, then
    collected from every pipeline stage (a weight two stages hold must be the same on both)."""
    topology = engine.topology
    if topology.tensor_model_parallel_size > 1 or topology.expert_model_parallel_size > 1:
        from mega.parallel.tensor import gather_full_parameters

        params = gather_full_parameters(engine.model, engine.topology)
        params = {name: value.cpu() for name, value in params.items()}
    else:
        params = {n: p.detach().float().clone() for n, p in engine.model.named_parameters()}
    group = engine.topology.group("pp")
    if group is None:
        return params
    import torch.distributed as dist

    stages: list[Any] = [None] * engine.topology.pipeline_model_parallel_size
    dist.all_gather_object(stages, params, group=group)
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, value in stage.items():
            if name in merged:  # the tied embeddings: the last stage's copy
                torch.testing.assert_close(value, merged[name], rtol=0, atol=1e-6, msg=name)
            merged.setdefault(name, value)
    return merged


def _train(rank: int, world_size: int, args: list[str], run_dir: str) -> dict[str, Any]:
    plugins = make_plugins()
    capture = _Losses()
    plugins.pm.register(capture)
    config = resolve_config([*args, "--run-dir", run_dir], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()
    params = full_parameters(engine)  # collective: every rank takes part
    return {
        "losses": capture.losses,
        "other_losses": capture.other_losses,
        "grad_norms": capture.grad_norms,
        "params": params if rank == 0 else None,
        "state_bytes": engine.optimizer.state_bytes(),
        "vocab_rows": engine.vocab_rows,  # {name: real rows} of the vocabulary-padded ones
        "engine_buckets": len(engine.buffer.buckets),
    }


def layout_run(args: list[str], world_size: int, run_dir: str) -> list[dict[str, Any]]:
    """Train ``args`` on ``world_size`` forked ranks; every rank's result."""
    return run_ranks(_train, world_size, args, run_dir, timeout=240)


@dataclass(frozen=True)
class ReluKinks:
    """What a ReLU's kink does to a layout comparison, and the bound that still catches bugs.

    A pre-activation within rounding of zero (two layouts sum in different orders) can land on
    one side of the kink in one run and on the other in the other: that unit's fc1 row (its input
    weights) then gets one token's gradient more or less in that step, and nothing else changes
    beyond rounding (its output is ~0 either way). Seen on an AMD EPYC CPU, t5-hf at TP2+SP: one
    row each of two fc1 weights 1.5e-5 and 8.8e-6 apart, their other rows within 6.5e-7. So up to
    ``max_rows`` rows of each fc1 weight may leave ``atol``, each within the most one token's
    gradient can move a row: Adam's step is about lr per element, and one token of ``tokens``
    (about half of them active at a unit) is ~1/sqrt(tokens/2) of the gradient's spread, so
    ``lr * iterations / sqrt(tokens / 2)``. A layout bug (missing reduction, wrong shard, wrong
    offset) moves rows by lr * iterations, or every row.
    """

    lr: float
    iterations: int
    tokens: int  # per step, into the MLPs
    # flips are rare (a pre-activation must fall within ~1e-6 of zero: two in ~5M here); a wrong
    # shard or reduction moves half the rows or more
    max_rows: int = 4
    weight_suffix: str = "mlp.linear_fc1.weight"

    @property
    def row_atol(self) -> float:
        return self.lr * self.iterations / math.sqrt(self.tokens / 2)

    def without_flipped_rows(
        self, name: str, got: torch.Tensor, value: torch.Tensor, rtol: float, atol: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checks the rows beyond ``atol`` (count and bound); returns the others to compare."""
        beyond = ((got - value).abs() > atol + rtol * value.abs()).any(dim=1)
        rows = beyond.nonzero().flatten().tolist()
        assert len(rows) <= self.max_rows, f"{name}: {len(rows)} rows differ, from {rows[:8]}"
        if rows:
            worst = (got[beyond] - value[beyond]).abs().max().item()
            assert worst <= self.row_atol, f"{name}: rows {rows} {worst:.3g} apart"
        return got[~beyond], value[~beyond]


def assert_same_training(
    reference: dict[str, Any],
    other: dict[str, Any],
    rel: float = 1e-5,
    atol: float = 1e-5,
    relu_kinks: ReluKinks | None = None,
) -> None:
    """Same per-iteration losses, every loss part (relative difference <= rel), and the same
    final parameters.

    Parameters get an absolute tolerance: a different layout sums in a different order, and
    Adam's m/(sqrt(v) + eps) turns the rounding of a small gradient into a different step (see
    EQUIVALENCE for why eps is 1e-6). Measured after 10 steps at lr 3e-3, PP2 x TP2 x DP2 with
    the 8-layer model: <= 1.5e-6 on any element, against about 1e-2 of movement. A real bug (a
    missing reduction, a wrong shard) moves them by O(lr) = 3e-3 or more. A ReLU MLP also needs
    ``relu_kinks`` (see ReluKinks).
    """
    ref_losses, losses = reference["losses"], other["losses"]
    assert len(ref_losses) == len(losses) > 0
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True), start=1):
        assert abs(a - b) <= rel * abs(a), f"iteration {i}: lm loss {b} vs {a}"
    ref_parts, parts = reference.get("other_losses", {}), other.get("other_losses", {})
    assert ref_parts.keys() == parts.keys(), f"loss parts {sorted(parts)} vs {sorted(ref_parts)}"
    for key, ref_values in ref_parts.items():
        assert len(ref_values) == len(parts[key]) == len(ref_losses), key
        for i, (a, b) in enumerate(zip(ref_values, parts[key], strict=True), start=1):
            assert abs(a - b) <= rel * abs(a), f"iteration {i}: {key} {b} vs {a}"
    # the clipping norm: Adam hides a wrong one (it is nearly scale-invariant), so check it here
    pairs = zip(reference["grad_norms"], other["grad_norms"], strict=True)
    for i, (a, b) in enumerate(pairs, start=1):
        assert abs(a - b) <= 10 * rel * abs(a), f"iteration {i}: grad norm {b} vs {a}"
    ref_params, params = reference["params"], other["params"]
    assert ref_params.keys() == params.keys()
    for name, value in ref_params.items():
        got = params[name]
        if got.shape != value.shape:  # vocabulary padded differently: compare the common rows
            rows = min(got.shape[0], value.shape[0])
            got, value = got[:rows], value[:rows]
        if relu_kinks is not None and name.endswith(relu_kinks.weight_suffix):
            got, value = relu_kinks.without_flipped_rows(name, got, value, rel * 10, atol)
        # torch's message names the largest difference and the allowed one; prefix the parameter
        torch.testing.assert_close(
            got,
            value,
            rtol=rel * 10,
            atol=atol,
            msg=lambda message, name=name: f"{name}: {message}",
        )
