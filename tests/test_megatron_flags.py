"""Megatron flags from the guides (issue 15, item 4): each does what Megatron's does.

Old spellings and shorthands resolve to the flags they stand for; --train-samples, the
--lr-*-samples flags and --rampup-batch-size follow Megatron's update_train_iters, its
RampupBatchsizeNumMicroBatchesCalculator and its sample-counting scheduler; --finetune,
--no-load-optim, --no-load-rng and --use-checkpoint-args follow load_checkpoint; --optimizer sgd
is torch's SGD; per-split data paths, --num-workers and the W&B sink do what they say."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from mega.core.config.resolve import resolve_config
from mega.core.schedules.samples import BatchSchedule, train_iters_from_samples
from mega.core.training.engine import Engine
from mega.errors import MegaUsageError

from conftest import TINY, lm_losses, run_mega

SMALL = [*TINY, "--eval-iters", "0"]
# without TINY's architecture flags (--num-layers 2 --hidden-size 32), for --use-checkpoint-args
ARCHLESS = [a for i, a in enumerate(SMALL) if not (
    a in ("--num-layers", "--hidden-size") or SMALL[i - 1] in ("--num-layers", "--hidden-size")
)]  # fmt: skip


def resolve(plugins, *args):
    return resolve_config([*SMALL, *args], plugins)


# --- renames and shorthands ---------------------------------------------------------------------


def test_torchrun_underscore_spellings_are_the_launch_flags(plugins):
    config = resolve(
        plugins, "--nproc_per_node", "2", "--node_rank", "1", "--nnodes", "2", "--global-batch-size", "16",
        "--master_addr", "10.1.2.3", "--master_port", "1234",
    )  # fmt: skip
    launch = config.launch
    assert (launch.nproc_per_node, launch.node_rank, launch.master_addr, launch.master_port) == (
        2, 1, "10.1.2.3", 1234,
    )  # fmt: skip


def test_use_flash_attn_selects_the_flash_backend(plugins):
    flash = resolve(plugins, "--use-flash-attn", "--attention-dropout", "0")
    assert flash.model.attention_backend == "flash"
    assert resolve(plugins).model.attention_backend == "auto"
    with pytest.raises(MegaUsageError, match="--use-flash-attn means --attention-backend flash"):
        resolve(plugins, "--use-flash-attn", "--attention-backend", "unfused")


def test_recompute_shorthands(plugins):
    p = resolve(plugins, "--recompute-activations").parallel
    assert (p.recompute_granularity, p.recompute_method) == ("selective", None)
    p = resolve(plugins, "--use-checkpoint-activations").parallel
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        "full", "uniform", 1,
    )  # fmt: skip
    p = resolve(plugins, "--checkpoint-activations", "--checkpoint-num-layers", "2").parallel
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        "full", "uniform", 2,
    )  # fmt: skip
    with pytest.raises(MegaUsageError, match="--recompute-activations means"):
        resolve(plugins, "--recompute-activations", "--recompute-granularity", "full")


def test_use_checkpoint_activations_recomputes_like_full_uniform(plugins):
    """Same losses as the explicit flags (recompute changes memory, never the numbers)."""
    from mega.testing.commands import invoke

    base = [*SMALL, "--train-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]
    old = invoke(["train", *base, "--use-checkpoint-activations"], plugins)
    new = invoke(["train", *base, "--recompute-granularity", "full", "--recompute-method",
                  "uniform", "--recompute-num-layers", "1"], plugins)  # fmt: skip
    assert old.exit_code == new.exit_code == 0, old.stderr + new.stderr
    assert lm_losses(old.output) == lm_losses(new.output) and lm_losses(old.output)


def test_log_throughput_is_accepted_and_the_line_has_throughput(mega_cli, tmp_path):
    done = mega_cli(["train", *SMALL, "--train-iters", "1", "--log-throughput",
                     "--run-dir", str(tmp_path / "r")])  # fmt: skip
    assert done.exit_code == 0, done.stderr
    assert "throughput per GPU (TFLOP/s/GPU):" in done.output


def test_json_key_is_json_keys():
    from mega.core.config.flags import FlagTable
    from mega.plugins.datasets.preprocess.config import PreprocessConfig

    values, errors = FlagTable({"p": PreprocessConfig}).parse(["--json-key", "body", "title"])
    assert errors == [] and values["p"]["json_keys"] == ["body", "title"]


# --- --train-samples, sample-based LR, --rampup-batch-size --------------------------------------


def test_train_iters_from_samples_as_megatron_update_train_iters():
    assert train_iters_from_samples(1000, BatchSchedule(32, 4)) == 31  # partial batch dropped
    # ramp 8 -> 32 by 8 over 300 samples: 13 steps of 8 (to 104), 6 of 16 (to 200), 5 of 24
    # (to 320 > 300), then (1000 - 320) // 32 = 21 steps of 32
    ramp = BatchSchedule(32, 4, 8, 8, 300)
    assert [
        ramp.at(c) for c in (0, 99, 100, 199, 200, 300, 301)
    ]  # 300: int(300 / 100) increments == [8, 8, 16, 16, 24, 32, 32]
    assert train_iters_from_samples(1000, ramp) == 13 + 6 + 5 + 21
    assert ramp.num_microbatches(200) == 6


def test_sample_flags_are_checked_as_megatron_asserts(plugins):
    cases = {
        ("--train-samples", "80", "--train-iters", "5"): "not both",
        ("--train-samples", "80", "--lr-decay-iters", "5"): "use --lr-decay-samples",
        ("--lr-warmup-samples", "5"): "needs --train-samples",
        ("--rampup-batch-size", "4", "4", "40"): "--rampup-batch-size needs --train-samples",
        ("--train-samples", "80", "--rampup-batch-size", "4", "3", "40"): "multiple of INCREMENT",
        ("--train-samples", "80", "--rampup-batch-size", "2", "2", "40"): "multiples of",
        ("--train-samples", "80", "--rampup-batch-size", "4", "4"): "three integers",
    }
    for args, message in cases.items():
        with pytest.raises(MegaUsageError, match=message):
            resolve(plugins, *args)


def _megatron_lr(samples: float, peak=1e-3, warmup=20, decay=200) -> float:
    """get_lr of Megatron's OptimizerParamScheduler at num_steps = samples (cosine, min 0)."""
    if samples <= warmup:
        return peak * samples / warmup
    if samples > decay:
        return 0.0
    return peak * 0.5 * (math.cos(math.pi * (samples - warmup) / (decay - warmup)) + 1.0)


def test_rampup_and_sample_based_schedule_in_a_run(mega_cli, tmp_path):
    """Global batch 4, 4, 4, 4, 8, 8, 12, 12, then 16; consumed samples and the learning rate
    (counted in samples) exactly as Megatron's; the checkpoints Megatron writes when the number
    of micro-batches changes; iterations from --train-samples."""
    args = [*TINY, "--global-batch-size", "16", "--train-samples", "200", "--eval-iters", "0",
            "--rampup-batch-size", "4", "4", "48", "--lr-warmup-samples", "20",
            "--save", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run")]  # fmt: skip
    done = mega_cli(["train", *args])
    assert done.exit_code == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "lm_loss" in r]
    assert len(steps) == 17  # 8 ramp steps (56 samples), then (200 - 56) // 16
    assert [r["global_batch_size"] for r in steps] == [4] * 4 + [8] * 2 + [12] * 2 + [16] * 9
    consumed = [r["consumed_samples"] for r in steps]
    assert consumed == list(np.cumsum([r["global_batch_size"] for r in steps]))
    for r in steps:
        assert r["learning_rate"] == pytest.approx(_megatron_lr(r["consumed_samples"]), rel=1e-12)
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*"))
    # before iterations 5, 7 and 9 the micro-batch count changes; and the end
    assert saved == ["iter_0000004", "iter_0000006", "iter_0000008", "iter_0000017"]


def test_resume_inside_a_ramp_continues_the_same_run(mega_cli, tmp_path):
    base = [*TINY, "--global-batch-size", "16", "--train-samples", "120", "--eval-iters", "0",
            "--rampup-batch-size", "4", "4", "48", "--hidden-dropout", "0",
            "--attention-dropout", "0"]  # fmt: skip
    whole = mega_cli(["train", *base, "--run-dir", str(tmp_path / "a")])
    assert whole.exit_code == 0, whole.stderr
    ckpt = tmp_path / "ckpt"
    first = mega_cli(["train", *base, "--save", str(ckpt), "--run-dir", str(tmp_path / "b")])
    assert first.exit_code == 0, first.stderr
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6\n")  # resume mid-ramp
    resumed = mega_cli(["train", *base, "--load", str(ckpt), "--run-dir", str(tmp_path / "c")])
    assert resumed.exit_code == 0, resumed.stderr
    ref, mine = lm_losses(whole.output), lm_losses(resumed.output)
    assert min(mine) == 7 and all(mine[i] == ref[i] for i in mine)


# --- checkpoint loading flags ---------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, mega_cli):
    ckpt = tmp_path / "ckpt"
    done = mega_cli(["train", *SMALL, "--num-layers", "3", "--hidden-size", "48",
                     "--train-iters", "4", "--save", str(ckpt), "--run-dir", str(tmp_path / "r")])  # fmt: skip
    assert done.exit_code == 0, done.stderr
    return ckpt


def _engine(plugins, *args) -> Engine:
    engine = Engine(resolve_config([*SMALL, *args], plugins), plugins)
    engine.setup()
    return engine


def test_finetune_loads_weights_only(plugins, saved, tmp_path):
    arch = ["--num-layers", "3", "--hidden-size", "48", "--run-dir", str(tmp_path / "f")]
    resumed = _engine(plugins, *arch, "--train-iters", "4", "--load", str(saved))  # as saved
    weights = {name: value.clone() for name, value in resumed.model.state_dict().items()}
    resumed._shut_down(None)  # the shutdown hook: the sinks close
    engine = _engine(plugins, *arch, "--load", str(saved), "--finetune")
    assert (engine.iteration, engine.consumed_samples, engine.scheduler_steps) == (0, 0, 0)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, weights[name])
    assert not engine.optimizer.states["exp_avg"].any() and int(engine.optimizer._step) == 0
    engine._shut_down(None)


def test_no_load_optim_and_no_load_rng(plugins, saved, tmp_path):
    arch = ["--num-layers", "3", "--hidden-size", "48", "--train-iters", "4"]
    arch += ["--run-dir", str(tmp_path / "o")]
    engine = _engine(plugins, *arch, "--load", str(saved), "--no-load-optim")
    assert engine.iteration == 4 and engine.consumed_samples == 32
    assert not engine.optimizer.states["exp_avg"].any()
    engine._shut_down(None)
    engine = _engine(plugins, *arch, "--load", str(saved))
    assert engine.optimizer.states["exp_avg"].any()
    after_load = torch.get_rng_state()
    engine._shut_down(None)
    engine = _engine(plugins, *arch, "--load", str(saved), "--no-load-rng")
    assert engine.iteration == 4 and not torch.equal(torch.get_rng_state(), after_load)
    engine._shut_down(None)


def test_use_checkpoint_args_takes_the_architecture(plugins, saved):
    load = ["--load", str(saved), "--use-checkpoint-args"]
    config = resolve_config([*ARCHLESS, *load], plugins)
    assert (config.model.num_layers, config.model.hidden_size) == (3, 48)
    without = resolve_config([*ARCHLESS, "--load", str(saved)], plugins).model
    assert (without.num_layers, without.hidden_size) == (4, 128)  # the defaults
    config = resolve_config(
        [*ARCHLESS, *load, "--num-layers", "3", "--hidden-dropout", "0"], plugins
    )
    assert (config.model.num_layers, config.model.hidden_dropout) == (3, 0.0)  # agree, or free
    with pytest.raises(MegaUsageError) as conflict:
        resolve_config([*ARCHLESS, *load, "--num-layers", "2", "--swiglu"], plugins)
    assert conflict.value.messages == [
        "--num-layers 2: the checkpoint's model has num_layers = 3 (--use-checkpoint-args);"
        " drop it or load another checkpoint",
        "--swiglu: the checkpoint's model has swiglu = False (--use-checkpoint-args);"
        " drop it or load another checkpoint",
    ]
    with pytest.raises(MegaUsageError, match="--use-checkpoint-args needs --load"):
        resolve(plugins, "--use-checkpoint-args")


def test_use_checkpoint_args_end_to_end(mega_cli, saved, tmp_path):
    done = mega_cli(["train", *ARCHLESS, "--train-iters", "5", "--lr-decay-iters", "4", "--load", str(saved),
                     "--use-checkpoint-args", "--run-dir", str(tmp_path / "u")])  # fmt: skip
    assert done.exit_code == 0, done.stderr
    assert "loaded checkpoint" in done.output and "iteration        5/       5" in done.output


# --- --optimizer sgd ----------------------------------------------------------------------------


def test_sgd_flat_equals_torch_sgd():
    from mega.parallel.data.flat_sgd import sgd_flat_

    torch.manual_seed(0)
    start, grads = torch.randn(50), [torch.randn(50) for _ in range(4)]
    reference = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=0.01)
    master, buf, step = start.clone(), torch.zeros(50), torch.zeros(())
    for g in grads:
        reference.grad = g.clone()
        opt.step()
        step += 1
        sgd_flat_(master, g.clone(), (buf,), None, lr=torch.tensor(0.1),
                  weight_decay=0.01, momentum=0.9, step=step, grad_scale=torch.ones(()),
                  skip=torch.tensor(False))  # fmt: skip
        torch.testing.assert_close(master, reference.detach(), rtol=1e-6, atol=1e-7)


def test_optimizer_sgd_trains_and_refuses_an_adam_checkpoint(mega_cli, tmp_path):
    args = [*SMALL, "--train-iters", "3", "--optimizer", "sgd", "--lr", "0.05"]
    done = mega_cli(["train", *args, "--sgd-momentum", "0.5", "--save", str(tmp_path / "s")])
    assert done.exit_code == 0, done.stderr
    adam = mega_cli(["train", *SMALL, "--train-iters", "4", "--load", str(tmp_path / "s"),
                     "--run-dir", str(tmp_path / "a")])  # fmt: skip
    assert adam.exit_code == 2 and "optimizer is sgd" in adam.stderr
    assert mega_cli(["train", *SMALL, "--optimizer", "lamb"]).exit_code == 2


# --- --train-data-path / --valid-data-path / --test-data-path -----------------------------------


def _corpus(path: Path, seed: int) -> str:
    from mega.plugins.datasets.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(path, dtype=np.uint16)
    for _ in range(80):
        builder.add_document([[*rng.integers(0, 100, int(rng.integers(5, 60))).tolist(), 100]])
    builder.finalize()
    return str(path)


def test_data_paths_per_split(tmp_path, plugins):
    from mega import BuildContext, DataRequest
    from mega.plugins.datasets.gpt import GPTDatasetConfig, build_gpt
    from mega.plugins.datasets.gpt.builder import build_gpt_splits
    from mega.plugins.datasets.gpt.samples import SampleOptions

    train, valid = _corpus(tmp_path / "t", 1), _corpus(tmp_path / "v", 2)
    tokenizer = plugins.tokenizers.get("NullTokenizer")
    tok = tokenizer.build(tokenizer.config_cls(vocab_size=100))
    ctx = BuildContext(seed=7, device="cpu", params_dtype="float32", seq_length=16, tokenizer=tok)
    request = DataRequest(split="969,30,1", data_path=(), num_samples=(40, 10, 0),
                          cache_path=str(tmp_path / "c"), split_paths=((train,), (valid,), ()))  # fmt: skip
    splits = build_gpt(GPTDatasetConfig(), request, ctx)
    assert splits.test is None
    options = SampleOptions(seq_length=16, eod=tok.eod, pad=-1)
    whole_train = build_gpt_splits([train], "1,0,0", (40, 10, 0), 7, options).splits[0]
    whole_valid = build_gpt_splits(
        [valid], "0,1,0", (40, 10, 0), 7, options, wanted=(False, True, False)
    ).splits[1]
    for mine, ref in ((splits.train, whole_train), (splits.valid, whole_valid)):
        assert len(mine) == len(ref)
        assert all((mine[i]["tokens"] == ref[i]["tokens"]).all() for i in range(len(ref)))


def test_train_and_valid_data_path_train_and_evaluate(tmp_path):
    train, valid = _corpus(tmp_path / "t", 1), _corpus(tmp_path / "v", 2)
    args = [*TINY, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters",
            "2", "--eval-interval", "2", "--eval-iters", "1", "--train-data-path", train,
            "--valid-data-path", valid, "--run-dir", str(tmp_path / "r")]  # fmt: skip
    done = run_mega(["train", *args], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "data gpt" in done.stdout and "validation loss at iteration 2" in done.stdout
    assert "test loss" not in done.stdout
    both = run_mega(["train", *args, "--data-path", train], cwd=tmp_path)
    assert both.returncode == 2 and "not both" in both.stderr


# --- --num-workers ------------------------------------------------------------------------------


def test_num_workers_prefetch_gives_the_same_run(mega_cli, tmp_path):
    base = [*SMALL, "--train-iters", "3", "--global-batch-size", "16"]
    plain = mega_cli(["train", *base, "--run-dir", str(tmp_path / "a")])
    workers = mega_cli(["train", *base, "--num-workers", "2", "--run-dir", str(tmp_path / "b")])
    assert plain.exit_code == workers.exit_code == 0, plain.stderr + workers.stderr
    assert lm_losses(plain.output) == lm_losses(workers.output)


def test_prefetcher_builds_the_batch_it_is_asked_for():
    from mega.core.training.batches import BatchPrefetcher, global_batch

    source = [{"tokens": np.full(2, i)} for i in range(100)]
    build = lambda src, start, size: global_batch(src, start, size, 2, torch.device("cpu"))  # noqa: E731
    prefetch = BatchPrefetcher(3, unit=2)
    prefetch.ahead(build, source, 10, 8)
    got = prefetch.take(build, source, 10, 8)
    assert [mb["tokens"][:, 0].tolist() for mb in got] == [[10, 11], [12, 13], [14, 15], [16, 17]]
    prefetch.ahead(build, source, 18, 8)
    assert prefetch.take(build, source, 30, 4)[0]["tokens"][:, 0].tolist() == [30, 31]
    prefetch.close()


# --- W&B -----------------------------------------------------------------------------------------


def test_wandb_sink_logs_megatron_tags_through_the_package(monkeypatch, tmp_path):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from mega.core.console.wandb_sink import WandbSink

    sink = WandbSink("proj", "exp", tmp_path / "w", {"training": {"seed": 1}})
    sink.write({"iteration": 3, "lm_loss": 2.5, "learning_rate": 1e-3, "consumed_samples": 24})
    sink.close()
    assert calls[0] == ("init", {"project": "proj", "name": "exp", "dir": str(tmp_path / "w"),
                                 "config": {"training": {"seed": 1}}})  # fmt: skip
    assert calls[1] == ("log", {"lm loss": 2.5, "learning-rate": 1e-3}, 3)
    assert calls[2] == ("finish",)


def test_wandb_missing_package_is_one_line(monkeypatch, plugins):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(MegaUsageError) as error:
        resolve(plugins, "--wandb-project", "p")
    assert (
        "--wandb-project needs the wandb package: pip install 'mega[wandb]'" in error.value.messages
    )
    with pytest.raises(MegaUsageError, match="need --wandb-project"):
        resolve(plugins, "--wandb-exp-name", "x")


def test_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    args = [*SMALL, "--train-iters", "2", "--wandb-project", "mega-test", "--wandb-exp-name",
            "tiny", "--run-dir", str(tmp_path / "r")]  # fmt: skip
    done = run_mega(["train", *args], cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr
    (log,) = (tmp_path / "r" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert b"lm loss" in data and b"mega-test" in data and b"tiny" in data


def test_use_flash_attn_trains_on_the_cpu_without_attention_dropout(mega_cli, tmp_path):
    base = [*SMALL, "--train-iters", "1", "--device", "cpu", "--run-dir", str(tmp_path / "r")]
    done = mega_cli(["train", *base, "--use-flash-attn", "--attention-dropout", "0"])
    assert done.exit_code == 0, done.stderr
    refused = mega_cli(["train", *base, "--use-flash-attn"])
    assert refused.exit_code == 2
    assert "needs --attention-dropout 0" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.parametrize("ckpt_format", ["torch", "zarr"])
def test_a_fresh_optimizer_takes_its_fp32_masters_from_the_loaded_weights(
    tmp_path, mega_cli, plugins, ckpt_format
):
    """--finetune / --no-load-optim in a bf16 run: as Megatron's reload_model_params, the masters
    are the loaded weights (not the initial ones, which the first step would otherwise update)."""
    ckpt = tmp_path / "ckpt"
    done = mega_cli(["train", *SMALL, "--bf16", "--train-iters", "3", "--save", str(ckpt),
                     "--ckpt-format", ckpt_format, "--run-dir", str(tmp_path / "s")])  # fmt: skip
    assert done.exit_code == 0, done.stderr
    for flag in ("--finetune", "--no-load-optim"):
        engine = _engine(plugins, "--bf16", "--train-iters", "3", "--load", str(ckpt), flag,
                         "--run-dir", str(tmp_path / flag))  # fmt: skip
        fresh = _engine(plugins, "--bf16", "--run-dir", str(tmp_path / f"{flag}-fresh"))
        for (name, param), (_, initial) in zip(
            engine.model.named_parameters(), fresh.model.named_parameters(), strict=True
        ):
            master = engine.optimizer.master_of(param).view_as(param)
            assert torch.equal(master, param.float()), name
            if param.dim() == 2:  # trained away from the init (bf16 keeps norm weights at 1)
                assert not torch.equal(param, initial), name
        engine._shut_down(None)
        fresh._shut_down(None)
