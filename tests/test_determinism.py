"""Same flags, same bits on the CPU. Two identical runs started together (each slowing the
other, as a busy machine does) print the same losses to the last digit. The one input outside
the flags that changes them is torch's intra-op thread count (a float sum splits differently over
threads); a run says it uses, and a resume with another warns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TINY, run_mega

FLAGS = [*TINY, "--mock-data", "--hidden-dropout", "0.1"]  # dropout on: its masks must agree too


def _start(run_dir: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MEGA_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mega",
            "train",
            *FLAGS,
            "--train-iters",
            "12",
            "--run-dir",
            str(run_dir),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in records if "lm_loss" in r]


def test_identical_runs_side_by_side_give_identical_bits(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    procs = [_start(run, threads=2) for run in runs]  # three 2-thread runs on a 2-core machine
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    first = _losses(runs[0])
    assert len(first) == 12
    for run in runs[1:]:
        assert _losses(run) == first  # exact float equality, every iteration


def test_a_resume_on_another_thread_count_says_so(tmp_path):
    save = tmp_path / "ckpt"
    env = {"OMP_NUM_THREADS": "2"}
    done = run_mega(
        ["train", *FLAGS, "--train-iters", "12", "--save", str(save)], cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "2 CPU threads" in done.stdout
    longer = ["train", *FLAGS, "--train-iters", "14", "--lr-decay-iters", "12", "--load", str(save)]
    done = run_mega(longer, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert (
        "warning: this run uses 1 CPU thread and the checkpoint was trained with 2:"
        " float sums split differently over threads, so the losses will differ in the last digits"
        in done.stderr
    )


def test_a_cpu_run_settles_mkl_vector_math_before_its_first_step(tmp_path, monkeypatch):
    """MKL's vector math picks each function's kernel on its first call, unsafely when that call
    runs on several threads (``mega.core.training.cpu_math``): the run makes the first calls on
    one thread, before the optimizer's first ``sqrt``. The race itself needs a loaded machine
    and many runs to show (about one set in twenty of the side-by-side runs above, before)."""
    import mega.core.training.engine as engine_module
    from mega.core.config.resolve import resolve_config
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.cpu_math import warm_up_vector_math
    from mega.parallel.data.optimizer import FlatOptimizer

    events = []
    step = FlatOptimizer.step
    monkeypatch.setattr(engine_module, "warm_up_vector_math", lambda: events.append("warm"))
    monkeypatch.setattr(
        FlatOptimizer, "step", lambda *a, **k: (events.append("step"), step(*a, **k))[1]
    )
    plugins = make_plugins()
    args = [*FLAGS, "--train-iters", "2", "--run-dir", str(tmp_path)]
    engine_module.Engine(resolve_config(args, plugins), plugins, Display(enabled=False)).train()
    assert events == ["warm", "step", "step"]
    warm_up_vector_math()  # the real one runs every function it names
