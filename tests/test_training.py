"""The engine's loop, numerically: accumulation, precision, loss scaling, hooks and run files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mega import ModelSpec, hookimpl
from mega.core.config.resolve import load_config_file, resolve_config
from mega.core.console.display import Display
from mega.core.plugins.manager import make_plugins
from mega.core.training.engine import Engine

from conftest import TINY


def train(args: list[str], plugins=None, tmp_path: Path | None = None) -> Engine:
    plugins = plugins or make_plugins()
    if tmp_path is not None:
        args = [*args, "--run-dir", str(tmp_path / "run")]
    engine = Engine(resolve_config(args, plugins), plugins, Display(rich_output=False))
    engine.train()
    return engine


def records(engine: Engine) -> list[dict]:
    lines = (engine.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "lm_loss" in line]


def test_loss_falls_and_run_files_are_written(tmp_path: Path):
    engine = train([*TINY, "--train-iters", "30", "--save", str(tmp_path / "ckpt")])
    rows = records(engine)
    assert [r["iteration"] for r in rows] == list(range(1, 31))
    assert rows[0]["lm_loss"] > rows[-1]["lm_loss"] + 0.5
    # padded rows are masked out of the softmax: the start is ln(real vocabulary)
    assert abs(rows[0]["lm_loss"] - math.log(engine.tokenizer.vocab_size)) < 0.2
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "iter_0000030" / "complete.json").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "30\n"
    assert "mega==0.1.0" in (ckpt / "plugins.txt").read_text()
    resolved = load_config_file(str(ckpt / "config.resolved.toml"))
    assert resolved["model"]["name"] == "gpt" and resolved["model"]["num_layers"] == 2


def test_resolved_config_file_reproduces_the_config(tmp_path: Path, plugins):
    config = resolve_config([*TINY, "--train-iters", "3", "--swiglu", "--bf16"], plugins)
    from mega.core.config.resolve import resolved_as_dict
    from mega.core.config.run_files import to_toml

    path = tmp_path / "config.toml"
    path.write_text(to_toml(resolved_as_dict(config)))
    again = resolve_config(["--config", str(path)], plugins)
    assert again == config


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path: Path):
    """2 micro-batches of 4 must give the same step as 1 micro-batch of 8 (fp32, no dropout)."""
    common = [*TINY, "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    two = train([*common, "--micro-batch-size", "4", "--global-batch-size", "8"], tmp_path=tmp_path)
    one = train(
        [*common, "--micro-batch-size", "8", "--global-batch-size", "8"], tmp_path=tmp_path / "b"
    )
    for a, b in zip(records(two), records(one), strict=True):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_bf16_keeps_fp32_masters_and_tracks_fp32_run(tmp_path: Path):
    common = [*TINY, "--train-iters", "10", "--hidden-dropout", "0", "--attention-dropout", "0"]
    bf16 = train([*common, "--bf16"], tmp_path=tmp_path)
    fp32 = train(common, tmp_path=tmp_path / "b")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert all(m.dtype == torch.float32 for m in bf16.optimizer.masters)
    # the model's bf16 weights are the rounded fp32 masters
    for p in bf16.model.parameters():
        assert torch.equal(p.reshape(-1), bf16.optimizer.master_of(p).to(torch.bfloat16))
    assert records(bf16)[-1]["lm_loss"] == pytest.approx(records(fp32)[-1]["lm_loss"], rel=0.02)


def test_no_weight_decay_on_biases_and_norms(plugins):
    config = resolve_config([*TINY, "--train-iters", "1"], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.setup()
    optimizer, ranges = engine.optimizer, engine.buffer.ranges
    assert optimizer.optim.weight_decay == 0.01
    # each parameter lies inside one segment, which decays exactly when the parameter is a matrix
    names = {id(p): n for n, p in engine.model.named_parameters()}
    decayed = set()
    for param, (lo, hi) in ranges.items():
        (segment,) = [s for s in optimizer.segments if s.lo <= lo and hi <= s.hi]
        assert segment.decay == (param.ndim == 2), names[id(param)]
        if segment.decay:
            decayed.add(names[id(param)].rsplit(".", 1)[-1])
    assert decayed == {"weight"}
    assert len(optimizer.segments) <= 2 * len(engine.buffer.buckets)  # matrices first per bucket


class PoisonedGPT:
    """A model plugin ``name``: GPT whose loss is multiplied by ``factor`` on forward call
    ``call`` (1e8 overflows fp16 gradients; NaN poisons them)."""

    def __init__(self, name: str, call: int, factor: float):
        self.name, self.call, self.factor = name, call, factor

    @hookimpl
    def register_models(self, register):
        from mega.plugins.models.gpt import GPTConfig, _build, flops_per_token

        target, factor = self.call, self.factor

        def build(cfg, ctx):
            model = _build(cfg, ctx)
            forward, calls = model.forward, [0]

            def poisoned(tokens, labels=None, **kwargs):
                out = forward(tokens, labels, **kwargs)
                calls[0] += 1
                return out * factor if calls[0] == target and labels is not None else out

            model.forward = poisoned
            return model

        register(ModelSpec(name=self.name, config_cls=GPTConfig, build=build,
                           flops_per_token=flops_per_token))  # fmt: skip


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path: Path):
    plugins = make_plugins(extra=[("overflow", PoisonedGPT("gpt-overflow", call=3, factor=1e8))])
    args = [*TINY, "--model", "gpt-overflow", "--fp16", "--train-iters", "5",
            "--initial-loss-scale", "65536", "--hysteresis", "1",
            "--micro-batch-size", "8", "--global-batch-size", "8"]  # fmt: skip
    seen = {}

    class Watch:
        @hookimpl(wrapper=True)
        def train_step(self, engine, microbatches, iteration):
            before = [p.detach().clone() for p in engine.model.parameters()]
            result = yield
            changed = any(
                not torch.equal(a, p)
                for a, p in zip(before, engine.model.parameters(), strict=True)
            )
            seen[iteration] = (result.skipped, result.loss_scale, changed)
            return result

    plugins.pm.register(Watch(), name="watch")
    engine = train(args, plugins, tmp_path)
    assert seen[3] == (True, 32768.0, False)  # skipped, halved, weights untouched
    assert all(seen[i][0] is False and seen[i][2] for i in (1, 2, 4, 5))
    assert seen[2][1] == 65536.0
    rows = [json.loads(x) for x in (engine.run_dir / "metrics.jsonl").read_text().splitlines()]
    third = next(r for r in rows if r["iteration"] == 3)
    assert third["skipped_iterations"] == 1 and third["skipped_total"] == 1
    assert "lm_loss" not in third and third["loss_scale"] == 32768.0
    assert rows[-1]["skipped_total"] == 1
    assert engine.skipped_total == 1


def test_hooks_fire_once_per_step_and_lifecycle(tmp_path: Path):
    calls: list[tuple] = []

    class Recorder:
        @hookimpl
        def validate_config(self, config):
            calls.append(("validate",))
            return []

        @hookimpl
        def topology_ready(self, topology):
            calls.append(("topology", topology.world_size))

        @hookimpl
        def step_end(self, engine, iteration, metrics):
            calls.append(("step_end", iteration, "lm_loss" in metrics))

        @hookimpl
        def checkpoint_saved(self, path, iteration):
            calls.append(("saved", iteration, Path(path).name))

        @hookimpl
        def shutdown(self, engine, exc):
            calls.append(("shutdown", exc))

    plugins = make_plugins(extra=[("recorder", Recorder())])
    args = [*TINY, "--train-iters", "4", "--log-interval", "2", "--save", str(tmp_path / "c"),
            "--save-interval", "2"]  # fmt: skip
    train(args, plugins)
    assert calls == [
        ("validate",),
        ("topology", 1),
        ("step_end", 1, True),  # iteration 1 is always logged
        ("step_end", 2, True),
        ("saved", 2, "iter_0000002"),
        ("step_end", 3, False),
        ("step_end", 4, True),
        ("saved", 4, "iter_0000004"),
        ("shutdown", None),
    ]


def test_validate_config_hook_errors_are_collected(plugins):
    class Strict:
        @hookimpl
        def validate_config(self, config):
            return ["strict plugin: --seq-length must be 64"]

    plugins.pm.register(Strict(), name="strict")
    from mega.errors import MegaUsageError

    with pytest.raises(MegaUsageError) as info:
        resolve_config([*TINY, "--fp16", "--bf16"], plugins)
    assert "strict plugin: --seq-length must be 64" in info.value.messages
    assert "--fp16 and --bf16 cannot both be set" in info.value.messages


def test_learning_rate_follows_megatron_schedule(tmp_path: Path):
    engine = train([*TINY, "--train-iters", "10", "--lr-warmup-iters", "2", "--lr", "0.01",
                    "--min-lr", "0.001", "--lr-decay-style", "linear"], tmp_path=tmp_path)  # fmt: skip
    lrs = [r["learning_rate"] for r in records(engine)]
    # logged after the scheduler steps (as Megatron logs): warmup ends at 2, linear to 10
    assert lrs[0] == pytest.approx(0.005)
    assert lrs[1] == pytest.approx(0.01)
    assert lrs[5] == pytest.approx(0.01 - 0.009 * 4 / 8)
    assert lrs[-1] == pytest.approx(0.001)


def test_tensorboard_events_are_written(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    train([*TINY, "--train-iters", "3", "--tensorboard-dir", str(tb)], tmp_path=tmp_path)
    events = EventAccumulator(str(tb))
    events.Reload()
    losses = [e.value for e in events.Scalars("lm loss")]
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3]
    assert all(3 < v < 7 for v in losses)


def test_shutdown_fires_when_setup_fails(tmp_path: Path):
    seen = []

    class Watch:
        @hookimpl
        def shutdown(self, engine, exc):
            seen.append(type(exc).__name__)

    plugins = make_plugins(extra=[("watch", Watch())])
    from mega.errors import MegaUsageError

    # the validation text (2 documents, ~4k bytes) cannot fill one 8k-token window
    args = [*TINY, "--seq-length", "8192", "--max-position-embeddings", "8192", "--eval-iters", "1"]
    with pytest.raises(MegaUsageError, match="dataset 'embedded'"):
        train(args, plugins, tmp_path)
    assert seen == ["MegaUsageError"]


def test_nan_in_fp32_stops_before_the_update(tmp_path: Path):
    from mega.errors import MegaRunError

    plugins = make_plugins(extra=[("nan", PoisonedGPT("gpt-nan", call=2, factor=float("nan")))])
    args = [*TINY, "--model", "gpt-nan", "--train-iters", "4", "--micro-batch-size", "8"]
    with pytest.raises(MegaRunError, match="iteration 2: NaN or inf in the gradients"):
        train(args, plugins, tmp_path)


def test_nan_in_fp16_is_skipped_and_counted_as_a_nan_iteration(tmp_path: Path):
    plugins = make_plugins(extra=[("nan", PoisonedGPT("gpt-nan", call=2, factor=float("nan")))])
    args = [*TINY, "--model", "gpt-nan", "--train-iters", "4", "--micro-batch-size", "8",
            "--fp16", "--initial-loss-scale", "1024"]  # fmt: skip
    engine = train(args, plugins, tmp_path)
    rows = [json.loads(x) for x in (engine.run_dir / "metrics.jsonl").read_text().splitlines()]
    second = next(r for r in rows if r["iteration"] == 2)
    assert second["skipped_iterations"] == 1 and second["nan_iterations"] == 1
    assert all(math.isfinite(p.detach().float().sum()) for p in engine.model.parameters())
