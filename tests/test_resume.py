"""A run SIGKILLed after its checkpoint at iteration k resumes to print the same losses, every digit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mega.testing.commands import with_free_port

from conftest import TINY, lm_losses, run_mega

# Dropout is on, so the resumed run matches only if the RNG state was restored too.
ARGS = [*TINY, "--train-iters", "12", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--lr-warmup-iters", "3", "--eval-interval", "4", "--eval-iters", "1"]  # fmt: skip
K = 6

# A plugin that stops the run right after the checkpoint at iteration K is complete, so the test
# can kill it at a known point (a real crash would land anywhere after the marker).
HANG_PLUGIN = """
import sys, time
from mega import hookimpl

@hookimpl
def checkpoint_saved(path, iteration):
    if iteration == {k}:
        print("CHECKPOINT-DONE", flush=True)
        time.sleep(120)
"""


def _kill_after_checkpoint(tmp_path: Path, args: list[str], k: int, ranks: int = 1) -> Path:
    """Run ``mega train args`` saving every ``k`` iterations into ``tmp_path/ckpt``; SIGKILL
    the whole job (launcher and workers) once each of its ``ranks`` has the checkpoint at ``k``
    complete. Returns the checkpoint root."""
    plugin_dir = tmp_path / "hang"
    plugin_dir.mkdir()
    (plugin_dir / "hang_after_checkpoint.py").write_text(HANG_PLUGIN.format(k=k))
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGA_PLUGINS_DIR": str(plugin_dir)}
    command = with_free_port(["train", *args, "--save", str(ckpt), "--save-interval", str(k)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "mega", *command],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        seen = ""
        for line in proc.stdout:
            seen += line
            if seen.count("CHECKPOINT-DONE") == ranks:  # ranks' lines may share one
                os.killpg(proc.pid, signal.SIGKILL)
                break
        assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert (ckpt / f"iter_{k:07d}" / "complete.json").is_file()
    return ckpt


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # a checkpoint mid-interval: iteration 8's line averages iterations 5-8, across it
        ["--log-interval", "4"],
        ["--bf16"],
        ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "4"],
    ],
    ids=["fp32", "log-interval-4", "bf16", "fp16-scaler-growing"],
)
def test_sigkill_then_resume_prints_identical_losses(tmp_path: Path, extra: list[str]):
    args = [*ARGS, *extra]
    full = run_mega(["train", *args], tmp_path)
    assert full.returncode == 0, full.stderr
    expected = lm_losses(full.stdout)
    logged = sorted(expected)
    assert logged[-1] == 12 and len(logged) >= 4

    ckpt = _kill_after_checkpoint(tmp_path, args, K)
    assert not (ckpt / "iter_0000012").exists()

    resumed = run_mega(["train", *args, "--load", str(ckpt), "--save", str(ckpt)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    got = lm_losses(resumed.stdout)
    assert got == {it: loss for it, loss in expected.items() if it > K}
    assert "loaded checkpoint" in resumed.stdout


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"]], ids=["tp2", "tp2-sp"])
def test_sigkill_then_resume_under_tensor_parallelism_with_dropout_is_exact(
    tmp_path: Path, extra: list[str]
):
    """The TP RNG tracker's stream (attention dropout on each rank's heads; under SP, every
    dropout on each rank's tokens) is saved per rank and restored at the same layout: without
    it the losses after the resume differ from iteration 11 on, by ~1e-5."""
    args = [*TINY, "--train-iters", "20", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
            "--tensor-model-parallel-size", "2", "--nproc-per-node", "2", *extra]  # fmt: skip
    full = run_mega(["train", *args], tmp_path)
    assert full.returncode == 0, full.stderr
    expected = lm_losses(full.stdout)
    assert sorted(expected) == list(range(1, 21))

    ckpt = _kill_after_checkpoint(tmp_path, args, 10, ranks=2)
    resumed = run_mega(["train", *args, "--load", str(ckpt)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "loaded checkpoint" in resumed.stdout
    assert lm_losses(resumed.stdout) == {it: loss for it, loss in expected.items() if it > 10}


def test_auto_resume_pattern_starts_fresh_when_save_dir_is_empty(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--train-iters", "2", "--load", str(ckpt), "--save", str(ckpt)]
    result = run_mega(["train", *args], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "starting from scratch" in result.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_resume_with_a_different_schedule_is_refused_unless_told(mega_cli, tmp_path: Path):
    # in this process (mega_cli): three runs of a process start each would cost 20 s
    ckpt = tmp_path / "ckpt"
    first = mega_cli(["train", *TINY, "--train-iters", "4", "--save", str(ckpt),
                      "--run-dir", str(tmp_path / "a")])  # fmt: skip
    assert first.exit_code == 0, first.stderr
    again = [*TINY, "--train-iters", "8", "--load", str(ckpt), "--run-dir", str(tmp_path / "b")]
    refused = mega_cli(["train", *again])
    assert refused.exit_code == 2
    assert "--lr-decay-iters: command line gives 8, checkpoint has 4" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    override = mega_cli(["train", *again, "--override-opt_param-scheduler"])
    assert override.exit_code == 0, override.stderr
    assert sorted(lm_losses(override.output)) == [5, 6, 7, 8]


def test_changed_data_order_settings_are_reported():
    from mega.core.checkpoint.resume_checks import data_changes

    saved = {"training": {"seed": 1234, "seq_length": 128}, "data": {"split": "969,30,1"}}
    now = {"training": {"seed": 7, "seq_length": 128}, "data": {"split": "969,30,1"}}
    (warning,) = data_changes(saved, now)
    assert warning.startswith("--seed is 7 but the checkpoint was trained with 1234")
    assert data_changes(saved, saved) == []
