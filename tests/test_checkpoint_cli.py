"""Sharded checkpoints from the command line, against the uninterrupted one-process run: save at
TP2 and resume at PP2 interleaved; SIGKILL during a save; SIGTERM with --exit-signal-handler;
--async-save, and a background write that fails."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_mega
from parallel_runs import EQUIVALENCE

ARGS = [*EQUIVALENCE, "--num-layers", "4", "--log-interval", "1"]
LOSS = re.compile(r"iteration +(\d+)/ *\d+ .*?lm loss: ([0-9.E+-]+)")


def losses(stdout: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(stdout)}


def train(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = run_mega(["train", *ARGS, *args], tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("one")
    return losses(train(tmp, "--train-iters", "12", "--run-dir", str(tmp / "run")).stdout)


def assert_continues(reference: dict[int, float], resumed: dict[int, float], first: int) -> None:
    assert sorted(resumed) == list(range(first, 13))
    for i, loss in resumed.items():
        assert abs(loss - reference[i]) <= 1e-5 * abs(reference[i]), (i, loss, reference[i])


def test_save_at_tp2_resume_at_pp2_interleaved(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "--train-iters", "12", "--nproc-per-node", "2",
          "--tensor-model-parallel-size", "2", "--save", ckpt, "--exit-interval", "4")  # fmt: skip
    resumed = train(tmp_path, "--train-iters", "12", "--nproc-per-node", "2",
                    "--pipeline-model-parallel-size", "2", "--parallel", "interleaved",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--load", ckpt)  # fmt: skip
    assert_continues(uninterrupted, losses(resumed.stdout), 5)


# A backend that is zarr's, but holds the save of iteration HOLD_AT after its writes started
# (announced on stdout) long enough for the test to kill the job mid-save; or, with
# FAIL_AT, whose background writes for that iteration fail.
SLOW_ZARR = """
import os, sys, time
from mega import CheckpointBackendSpec, hookimpl
from mega.plugins.checkpoint import zarr_tensorstore as z

def write(directory, tensors):
    wait = z.write(directory, tensors)
    name = directory.name
    if name == f".iter_{int(os.environ.get('HOLD_AT', -1)):07d}.tmp":
        print("SAVE-STARTED", flush=True)
        time.sleep(120)
    if name == f".iter_{int(os.environ.get('FAIL_AT', -1)):07d}.tmp":
        def failing():
            wait()
            raise OSError("model/decoder.layers.0.mlp.linear_fc1.weight: No space left on device")
        return failing
    return wait

@hookimpl
def register_checkpoint_backends(register):
    register(CheckpointBackendSpec(name="slowzarr", create=z.create, write=write, read=z.read))
"""


def plugin_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "slow_zarr.py").write_text(SLOW_ZARR)
    return {"MEGA_PLUGINS_DIR": str(plugin_dir), "MEGA_DISABLE_PLUGIN_AUTOLOAD": "0", **extra}


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **plugin_env(tmp_path, HOLD_AT="8")}
    args = [*ARGS, "--train-iters", "12", "--nproc-per-node", "2", "--use-distributed-optimizer",
            "--save", str(ckpt), "--save-interval", "4", "--ckpt-format", "slowzarr"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "mega", "train", *args], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "SAVE-STARTED" in line:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-save
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (ckpt / ".iter_0000008.tmp").is_dir() and not (ckpt / "iter_0000008").exists()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resumed = run_mega(["train", *ARGS, "--train-iters", "12", "--nproc-per-node", "2",
                        "--use-distributed-optimizer", "--load", str(ckpt),
                        "--run-dir", str(tmp_path / "r")], tmp_path, env=plugin_env(tmp_path))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("an unfinished checkpoint") == 1
    assert "loaded checkpoint" in resumed.stdout and "iteration 4" in resumed.stdout
    assert_continues(uninterrupted, losses(resumed.stdout), 5)


def test_sigterm_with_exit_signal_handler_saves_and_exits_0(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    hold = """
import os, signal, time
from mega import hookimpl
@hookimpl
def step_end(engine, iteration, metrics):
    if iteration == 6:
        os.kill(os.getpid(), signal.SIGTERM)  # as SLURM does before the time limit
        time.sleep(0.2)
"""
    plugin_dir = tmp_path / "term"
    plugin_dir.mkdir()
    (plugin_dir / "term_at_6.py").write_text(hold)
    env = {"MEGA_PLUGINS_DIR": str(plugin_dir), "MEGA_DISABLE_PLUGIN_AUTOLOAD": "0"}
    stopped = run_mega(["train", *ARGS, "--train-iters", "12", "--save", str(ckpt),
                        "--exit-signal-handler"], tmp_path, env=env)  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    assert "exiting after iteration 6: SIGTERM" in stopped.stdout
    assert (ckpt / "iter_0000006" / "complete.json").is_file()
    resumed = train(tmp_path, "--train-iters", "12", "--load", str(ckpt),
                    "--run-dir", str(tmp_path / "r"))  # fmt: skip
    assert_continues(uninterrupted, losses(resumed.stdout), 7)


def test_async_save_resumes_like_a_synchronous_one(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    first = train(tmp_path, "--train-iters", "12", "--save", ckpt, "--save-interval", "2",
                  "--async-save", "--exit-interval", "5")  # fmt: skip
    # saves at 2 and 4 went on in the background; the one at 4 was finished at the exit
    assert first.stdout.count("saved checkpoint at iteration") == 3  # 2, 4 and the exit's 5
    resumed = train(tmp_path, "--train-iters", "12", "--load", ckpt,
                    "--run-dir", str(tmp_path / "r"))  # fmt: skip
    assert_continues(uninterrupted, losses(resumed.stdout), 6)


def test_a_failed_background_write_fails_the_run_and_keeps_the_previous(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = run_mega(["train", *ARGS, "--train-iters", "8", "--save", str(ckpt),
                     "--save-interval", "2", "--async-save", "--ckpt-format", "slowzarr"],
                    tmp_path, env=plugin_env(tmp_path, FAIL_AT="4"))  # fmt: skip
    assert done.returncode == 1
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert line == (
        "error: the checkpoint at iteration 4 was not saved (rank 0: model/decoder.layers.0.mlp"
        ".linear_fc1.weight: No space left on device); the previous checkpoint is kept"
    )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002" / "complete.json").is_file()
