"""Ctrl-C of ``mega train`` says where it stopped and what ``--load`` resumes from; a resumed run
marks the restart in ``metrics.jsonl``; a repeated run does not overwrite the original's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mega.testing.commands import with_free_port

from conftest import TINY, run_mega

# Stops the run inside step_end of iteration STOP (after its iteration line), where the test
# sends SIGINT; time.sleep is interrupted by the KeyboardInterrupt.
STOP = 5
HANG_PLUGIN = f"""
import time
from mega import hookimpl

@hookimpl
def step_end(engine, iteration, metrics):
    if iteration == {STOP}:
        print("STEP-{STOP}-DONE", flush=True)
        time.sleep(120)
"""

ARGS = [*TINY, "--train-iters", "8", "--log-interval", "1", "--eval-interval", "4",
        "--eval-iters", "1"]  # fmt: skip


def _interrupt(tmp_path: Path, args: list[str], ranks: int = 1) -> subprocess.CompletedProcess:
    """Run ``mega train args`` until each of its ``ranks`` is held in iteration STOP, then Ctrl-C
    it as a terminal does: SIGINT to the whole process group (launcher and workers)."""
    plugin_dir = tmp_path / "hang"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "hang_in_step_end.py").write_text(HANG_PLUGIN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGA_PLUGINS_DIR": str(plugin_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mega", "train", *with_free_port(args)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        # a terminal's foreground job takes Ctrl-C; a job started with & from a script (a CI
        # runner's) inherits SIGINT ignored, and Python keeps it ignored: undo that in the child
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if "".join(out).count(f"STEP-{STOP}-DONE") == ranks:  # ranks' lines may share one
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out) + rest, err)


def test_ctrl_c_names_the_iteration_and_the_checkpoint_to_resume_from(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    stopped = _interrupt(tmp_path, [*ARGS, "--save", str(ckpt), "--save-interval", "4"])
    assert stopped.returncode == 130, stopped.stderr
    assert "Traceback" not in stopped.stderr
    (line,) = stopped.stderr.strip().splitlines()
    assert line == (
        f"interrupted after iteration {STOP} of 8; --load {ckpt} resumes from iteration 4"
        f" ({ckpt / 'iter_0000004'})"
    )


def test_ctrl_c_without_a_checkpoint_says_so(tmp_path: Path):
    stopped = _interrupt(tmp_path, [*ARGS, "--run-dir", str(tmp_path / "run")])
    assert stopped.returncode == 130, stopped.stderr
    (line,) = stopped.stderr.strip().splitlines()
    assert line == (
        f"interrupted after iteration {STOP} of 8; no checkpoint to resume from"
        " (--save DIR --save-interval N writes them)"
    )


def test_ctrl_c_of_a_launched_job_prints_one_line(tmp_path: Path):
    """The launcher and both workers get the SIGINT (and elastic forwards it once more): still
    rank 0's one line, exit 130, no blank line from the launcher or a worker."""
    stopped = _interrupt(
        tmp_path, [*ARGS, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], ranks=2
    )
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr == (
        f"interrupted after iteration {STOP} of 8; no checkpoint to resume from"
        " (--save DIR --save-interval N writes them)\n"
    )


# SIGTERM to the launcher of a 2-rank job, to its exit: 2.5-4.2 s measured on 2 loaded CPU cores
# (the step, a 0.2-0.6 s save, leaving the process group, the interpreters' exit); elastic's own
# handler waited its 30 s shutdown timeout for workers that had already returned (31 s, exit 1).
SIGTERM_EXIT_S = 15


def _sigterm_launcher(tmp_path: Path, args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``mega train --nproc-per-node 2 args`` until rank 0 has logged iteration 2, then
    SIGTERM the launcher alone (as ``kill PID`` does): the result and the seconds to its exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGA_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [
        sys.executable, "-m", "mega", "train", *TINY, "--train-iters", "100000",
        "--log-interval", "1", "--nproc-per-node", "2", *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        with_free_port(command), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if "iteration        2/" in line:
                break
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=90)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out) + rest, err), took


def test_sigterm_to_the_launcher_saves_and_exits_0_with_its_workers(tmp_path: Path):
    """--exit-signal-handler: the launcher passes SIGTERM on; the workers finish the step, save
    and exit 0, and the launcher exits 0 as soon as they have."""
    ckpt = tmp_path / "ckpt"
    stopped, took = _sigterm_launcher(tmp_path, ["--exit-signal-handler", "--save", str(ckpt)])
    assert stopped.returncode == 0, stopped.stderr
    assert took < SIGTERM_EXIT_S, f"{took:.1f} s"
    assert stopped.stderr == ""
    (line,) = [x for x in stopped.stdout.splitlines() if "exiting after iteration" in x]
    iteration = int(line.split("exiting after iteration ")[1].split(":")[0])
    assert line.endswith(f"exiting after iteration {iteration}: SIGTERM (--exit-signal-handler)")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(iteration)
    assert (ckpt / f"iter_{iteration:07d}" / "complete.json").is_file()


def test_sigterm_to_the_launcher_without_the_handler_stops_the_workers(tmp_path: Path):
    """No --exit-signal-handler: the workers die from the signal and the launcher says so."""
    stopped, took = _sigterm_launcher(tmp_path, ["--run-dir", str(tmp_path / "run")])
    assert stopped.returncode == 1, stopped.stderr
    assert took < SIGTERM_EXIT_S, f"{took:.1f} s"
    assert stopped.stderr == "error: stopped by SIGTERM; the workers were stopped too\n"


def test_resume_marks_the_restart_and_history_keeps_the_new_records(tmp_path: Path):
    from mega.core.console.metrics_history import read_history

    ckpt = tmp_path / "ckpt"
    stopped = _interrupt(tmp_path, [*ARGS, "--save", str(ckpt), "--save-interval", "4"])
    assert stopped.returncode == 130, stopped.stderr
    resumed = run_mega(["train", *ARGS, "--load", str(ckpt), "--save", str(ckpt)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr

    raw = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    markers = [r for r in raw if r.get("event") == "resume"]
    assert len(markers) == 1 and markers[0]["iteration"] == 4
    assert markers[0]["load"] == str(ckpt)
    # iteration 5 was logged twice: before the Ctrl-C, and again after the resume from 4
    logged = [r["iteration"] for r in raw if "lm_loss" in r]
    assert logged == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    after_marker = raw[raw.index(markers[0]) + 1 :]

    history = read_history(ckpt)
    iterations, losses = history.series("lm_loss")
    assert iterations == list(range(1, 9))
    assert losses[4] == next(r["lm_loss"] for r in after_marker if r.get("iteration") == 5)
    assert history.series("valid_lm_loss")[0] == [4, 8]


def test_history_drops_records_past_the_resume_point():
    from mega.core.console.metrics_history import read_history

    lines = [
        {"iteration": 1, "lm_loss": 5.0},
        {"iteration": 2, "lm_loss": 4.0},
        {"iteration": 3, "lm_loss": 3.9},  # the abandoned stretch after the checkpoint at 2
        {"iteration": 2, "valid_lm_loss": 4.2},
        {"iteration": 3, "valid_lm_loss": 4.1},  # abandoned too
        {"event": "resume", "iteration": 2},
        {"iteration": 4, "lm_loss": 3.5},
        {"iteration": 4, "test_lm_loss": 3.6},
    ]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "metrics.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{truncated")
        history = read_history(path)
    assert history.series("lm_loss") == ([1, 2, 4], [5.0, 4.0, 3.5])
    assert history.series("valid_lm_loss") == ([2], [4.2])
    assert history.series("test_lm_loss") == ([4], [3.6])


def test_repeating_a_run_from_its_resolved_config_does_not_overwrite_it(
    mega_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # in this process (mega_cli), from tmp_path as run_mega would: four process starts cost 16 s
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "runs" / "a"
    first = mega_cli(["train", *TINY, "--train-iters", "2", "--save", str(ckpt)])
    assert first.exit_code == 0, first.stderr
    before = (ckpt / "metrics.jsonl").read_text()
    checkpoint = (ckpt / "iter_0000002" / "complete.json").read_text()

    again = mega_cli(["train", "--config", str(ckpt / "config.resolved.toml")])
    assert again.exit_code == 2 and "Traceback" not in again.stderr
    (line,) = again.stderr.strip().splitlines()
    assert line == (
        f"error: --save {ckpt} already holds a run (a checkpoint at iteration 2) that this run"
        f" would overwrite: pass --load {ckpt} to continue it, or a new --save directory"
    )
    assert (ckpt / "metrics.jsonl").read_text() == before
    assert (ckpt / "iter_0000002" / "complete.json").read_text() == checkpoint

    # the ways out: a new --save, or --load of the same directory (continue)
    other = tmp_path / "runs" / "b"
    config = str(ckpt / "config.resolved.toml")
    moved = mega_cli(["train", "--config", config, "--save", str(other)])
    assert moved.exit_code == 0, moved.stderr
    more = ["--train-iters", "3", "--lr-decay-iters", "2"]
    continued = mega_cli(["train", "--config", config, *more, "--load", str(ckpt)])
    assert continued.exit_code == 0, continued.stderr
    assert "loaded checkpoint" in continued.output
    assert (ckpt / "iter_0000003" / "complete.json").is_file()


def test_a_reused_run_dir_is_refused_unless_loading(tmp_path: Path):
    run = tmp_path / "run"
    args = ["train", *TINY, "--train-iters", "1", "--run-dir", str(run)]
    assert run_mega(args, tmp_path).returncode == 0
    again = run_mega(args, tmp_path)
    assert again.returncode == 2
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith(f"error: --run-dir {run} already holds a run's metrics.jsonl")
