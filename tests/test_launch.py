"""Multi-process ``mega train``: launched by itself (--nproc-per-node), by torchrun and by SLURM.

Every run trains the same tiny dropout-free GPT; a layout of several processes must print the
one-process run's ``lm loss`` values, once (rank 0 owns the console). A rank that fails ends the
job with its own message, a one-line summary from the launcher and no hang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mega.testing.ranks import free_port

from conftest import LAUNCHER_VARS, TINY, lm_losses

ITERS = 4
# Dropout off (each layout would draw different masks) and no linear biases (the key bias has a
# zero gradient made of rounding noise, which Adam turns into steps; see parallel_runs.py).
ARGS = [
    *TINY, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
    "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear", "--mock-data",
]  # fmt: skip
TIMEOUT = 120  # seconds: far more than any of these runs needs; reaching it means a hang


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")
    }
    env.update({"OMP_NUM_THREADS": "1", "MEGA_DISABLE_PLUGIN_AUTOLOAD": "1", **extra})
    return env


def mega(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mega", *args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def losses(stdout: str) -> list[float]:
    printed = lm_losses(stdout)
    assert sorted(printed) == list(range(1, ITERS + 1)), stdout
    return [float(printed[i]) for i in sorted(printed)]


def assert_same_losses(expected: list[float], got: list[float]) -> None:
    for iteration, (a, b) in enumerate(zip(expected, got, strict=True), start=1):
        assert b == pytest.approx(a, rel=1e-5), f"iteration {iteration}: lm loss {b} vs {a}"


def assert_rank0_console_only(stdout: str) -> None:
    """One copy of every line: the iteration lines and the run's panel come from rank 0 only."""
    iteration_lines = [line for line in stdout.splitlines() if "| lm loss:" in line]
    assert len(iteration_lines) == ITERS, stdout
    assert stdout.count("mega: model gpt:") == 1, stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The one-process run's losses."""
    cwd = tmp_path_factory.mktemp("single")
    result = mega(["train", *ARGS], cwd)
    assert result.returncode == 0, result.stderr
    return losses(result.stdout)


@pytest.mark.parametrize(
    "layout",
    [["--nproc-per-node", "2"], ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]],
    ids=["dp2", "tp2"],
)
def test_nproc_per_node_matches_one_process(tmp_path: Path, reference, layout):
    result = mega(["train", *ARGS, *layout, "--master-port", str(free_port())], tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same_losses(reference, losses(result.stdout))
    assert_rank0_console_only(result.stdout)
    assert "Traceback" not in result.stderr and "[rank" not in result.stderr, result.stderr


def test_tp2_times_dp2_on_four_processes(tmp_path: Path, reference):
    layout = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "2"]
    result = mega(["train", *ARGS, *layout, "--master-port", str(free_port())], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dp 2 x" in result.stdout and "tp 2" in result.stdout, result.stdout
    assert_same_losses(reference, losses(result.stdout))
    assert_rank0_console_only(result.stdout)


def test_interleaved_pipeline_on_four_processes(tmp_path: Path):
    """The issue's command: 4 stages, one layer per virtual stage, the same losses as one process."""
    args = ["train", *ARGS, "--num-layers", "8"]
    one = mega(args, tmp_path)
    assert one.returncode == 0, one.stderr
    layout = [
        "--nproc-per-node", "4", "--pipeline-model-parallel-size", "4", "--parallel",
        "interleaved", "--num-layers-per-virtual-pipeline-stage", "1",
    ]  # fmt: skip
    result = mega([*args, *layout, "--master-port", str(free_port())], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "pp 4" in result.stdout and "[0-0] [4-4] | [1-1] [5-5]" in result.stdout, result.stdout
    assert_same_losses(losses(one.stdout), losses(result.stdout))
    assert_rank0_console_only(result.stdout)


def test_two_nodes_meet_at_the_master_port(tmp_path: Path, reference):
    """``--nnodes 2 --node-rank 0|1``, both nodes on this machine: one job of two workers."""
    common = ["train", *ARGS, "--nnodes", "2", "--nproc-per-node", "1"]
    common += ["--master-port", str(free_port())]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "mega", *common, "--node-rank", "1"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        node0 = mega([*common, "--node-rank", "0"], tmp_path)
        out1, err1 = node1.communicate(timeout=TIMEOUT)
    finally:
        node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    assert "world 2 = dp 2" in node0.stdout
    assert_same_losses(reference, losses(node0.stdout))
    assert out1 == ""  # node 1 holds rank 1 only: it prints nothing


def failing_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``--nproc-per-node 2`` with tests/failing_plugin.py loaded as a plugin file."""
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    shutil.copy(Path(__file__).with_name("failing_plugin.py"), plugin_dir)
    args = ["train", *ARGS, "--nproc-per-node", "2", "--master-port", str(free_port())]
    return mega(args, tmp_path, MEGA_PLUGINS_DIR=str(plugin_dir), **env)


def test_a_failing_rank_ends_the_job_with_its_message(tmp_path: Path):
    result = failing_run(tmp_path)  # rank 1 raises MegaRunError at iteration 2
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "[rank 1] error: planted failure on rank 1 at iteration 2",
        "error: rank 1 failed (exit code 1); see its message above",
    ], result.stderr
    assert "| lm loss:" in result.stdout  # rank 0 printed iteration 1 before the failure


def test_bad_input_on_a_rank_exits_2(tmp_path: Path):
    result = failing_run(tmp_path, FAIL_HOW="usage-error", FAIL_RANK="0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: planted bad input on rank 0 at iteration 2",  # rank 0 speaks unprefixed
    ], result.stderr


def test_bad_input_on_every_rank_is_shown_once(tmp_path: Path):
    """Every rank refuses the same input (a --load that does not fit the model, say): rank 0's
    line only, no [rank 1] copy and no summary line from the launcher."""
    result = failing_run(tmp_path, FAIL_HOW="usage-error", FAIL_RANK="all")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: planted bad input on rank 0 at iteration 2",
    ], result.stderr


def test_a_crashed_rank_is_named(tmp_path: Path):
    result = failing_run(tmp_path, FAIL_HOW="segfault")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "error: rank 1 died from SIGSEGV (exit code -11)", result.stderr


def test_bad_layout_fails_in_the_parent_before_any_worker(tmp_path: Path):
    args = ["train", *ARGS, "--nproc-per-node", "3", "--tensor-model-parallel-size", "2"]
    result = mega(args, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the world size (3 processes) is not divisible by --tensor-model-parallel-size (2)"
    ]
    assert result.stdout == ""  # no worker ran: nothing of rank 0's console
    assert not (tmp_path / "runs").exists()


def test_torchrun_runs_mega_as_its_workers(tmp_path: Path, reference):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "mega", "train", *ARGS,
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    assert_same_losses(reference, losses(result.stdout))
    assert_rank0_console_only(result.stdout)


def test_srun_style_tasks_train_together(tmp_path: Path, reference):
    """Two tasks started as ``srun --ntasks 2 mega train ...`` starts them: no launcher vars."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mega", "train", *ARGS],
            cwd=tmp_path,
            env=clean_env(
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                SLURM_NTASKS="2",
                SLURM_STEP_NUM_TASKS="2",
                SLURM_JOB_NODELIST="localhost",
                SLURM_JOB_ID="4242",
                MASTER_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    (out0, _), (out1, _) = outputs
    assert_same_losses(reference, losses(out0))
    assert_rank0_console_only(out0)
    assert out1 == ""  # rank 1 prints nothing on success


# ---------------------------------------------------------------- unit tests (no processes)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("localhost", "localhost"),
        ("node001", "node001"),
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("nid[001234,001240-001250]", "nid001234"),
        ("a100-[0003-0004]", "a100-0003"),
        ("gpu-a[1-2],gpu-b[3-4]", "gpu-a1"),
        ("cpu1,cpu2", "cpu1"),
    ],
)
def test_first_host_of_slurm_node_lists(nodelist: str, host: str):
    from mega.parallel.distributed import first_host

    assert first_host(nodelist) == host


def test_process_place_from_slurm_variables():
    from mega.parallel.distributed import process_place

    env = {
        "SLURM_PROCID": "11",
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_LOCALID": "3",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    place = process_place(env)
    assert (place.source, place.rank, place.world_size, place.local_rank) == ("slurm", 11, 16, 3)
    assert (place.master_addr, place.master_port) == ("gpu07", 20000 + 123456 % 20000)
    # an explicit MASTER_ADDR/MASTER_PORT (exported in the sbatch script) wins
    place = process_place({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"})
    assert (place.master_addr, place.master_port) == ("10.0.0.5", 29400)


def test_process_place_single_task_slurm_and_torchrun_precedence():
    from mega.parallel.distributed import process_place

    one_task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    assert process_place(one_task).source == "single"
    # the sbatch script of an 8-task job, before srun: not a worker, so it can run or launch
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert process_place(batch_script).source == "single"
    # torchrun inside a SLURM allocation: torchrun's variables describe the job
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_PORT": "29400"}
    place = process_place({**one_task, "SLURM_NTASKS": "2", **torchrun})
    assert (place.source, place.rank, place.world_size, place.master_port) == (
        "torchrun",
        1,
        4,
        29400,
    )


def test_display_warnings_carry_the_rank(capsys):
    from mega.core.console.display import Display

    Display(enabled=False, rank=3).warn("slow data loader")
    Display(rich_output=False, rank=0).warn("slow data loader")
    Display(enabled=False, rank=3).print("iteration line")  # not rank 0: not shown
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "[rank 3] warning: slow data loader",
        "warning: slow data loader",
    ]


@pytest.mark.parametrize(
    "env, prefix",
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "[rank 1] "),
        (
            {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_JOB_NODELIST": "n1"},
            "[rank 5] ",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ""),
        ({}, ""),
    ],
)
def test_main_prefixes_errors_of_other_ranks(monkeypatch, capsys, env, prefix):
    from mega.cli import main

    for name in LAUNCHER_VARS + ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "gtp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prefix}error: unknown model 'gtp'"), err


def test_threads_are_shared_out_among_workers(monkeypatch):
    from mega.cli import launch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert launch.threads_per_worker(4) == 4
    assert launch.threads_per_worker(32) == 1


def test_free_ports_lie_outside_the_range_outgoing_connections_take():
    """A test's rendezvous port must not be one the kernel may hand to a neighbour's outgoing
    connection between the pick and the launcher's bind (CI failed once on exactly that)."""
    from mega.testing.ranks import _ephemeral_ports

    low, high = _ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert not any(low <= p <= high for p in ports)
    assert len(set(ports)) > 40  # random picks, not one port handed to everyone
