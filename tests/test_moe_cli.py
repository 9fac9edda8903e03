"""``mega train --model moe`` from the command line: expert parallelism over launched
processes prints the one-process run's lines (losses and router statistics), and every MoE
layout problem is a one-line error before anything starts."""

from __future__ import annotations

import re

from mega.testing import run_mega

SMALL = [
    "train", "--model", "moe", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--moe-ffn-hidden-size", "32", "--seq-length", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
    "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--adam-eps", "1e-6",
    "--moe-expert-capacity-factor", "1.5", "--moe-z-loss-coeff", "1e-3",
]  # fmt: skip
LINE = re.compile(
    r"lm loss: (\S+) \| load_balancing_loss: (\S+) \| z_loss: (\S+) \| dropped tokens: (\S+)%"
)


def _lines(stdout: str) -> list[tuple[float, ...]]:
    return [tuple(float(x) for x in m.groups()) for m in LINE.finditer(stdout)]


def test_expert_parallel_processes_print_the_one_process_lines(tmp_path):
    one = run_mega([*SMALL, "--run-dir", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr
    two = run_mega(
        [*SMALL, "--nproc-per-node", "2", "--expert-model-parallel-size", "2",
         "--moe-token-dispatcher-type", "alltoall", "--run-dir", str(tmp_path / "two")],
        tmp_path,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr
    expected, got = _lines(one.stdout), _lines(two.stdout)
    assert len(expected) == len(got) == 4
    for a, b in zip(expected, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert abs(x - y) <= 1e-5 * max(abs(x), 1e-3), (expected, got)
    assert expected[-1][3] > 0  # the capacity dropped some tokens
    assert "ep 2 x edp 1" in two.stdout


def test_moe_layout_problems_are_one_line_errors_all_at_once(tmp_path):
    done = run_mega(
        [*SMALL, "--num-experts", "6", "--moe-router-topk", "8", "--nproc-per-node", "4",
         "--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
         "--moe-token-dispatcher-type", "nope", "--expert-tensor-parallel-size", "2"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    for fragment in (
        "--moe-router-topk (8) must be between 1 and --num-experts (6)",
        "--num-experts (6) must be divisible by --expert-model-parallel-size (4)",
        "needs --sequence-parallel",
        "--moe-token-dispatcher-type 'nope': no such dispatcher",
        "--expert-tensor-parallel-size 2",
    ):
        assert fragment in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_expert_parallelism_without_experts_is_refused(tmp_path):
    done = run_mega(
        ["train", "--model", "gpt", "--mock-data", "--nproc-per-node", "2",
         "--expert-model-parallel-size", "2"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert "model 'gpt' has no experts (give --num-experts)" in done.stderr
