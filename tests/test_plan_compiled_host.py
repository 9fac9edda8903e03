"""The host's time per kernel of a compiled unit (``Rates.compiled_op_host_seconds``): counted
apart from eager ops, measured by ``benchmarks/compiled_host_rate.py`` on the recorded runs the
built-in table names, and set aside when CUDA graphs replay the compiled units."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TINY = [
    "--model", "gpt", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--bf16", "--device", "cuda", "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip


def _plan(*flags: str):
    plugins = make_plugins()
    config = resolve_config([*TINY, *flags], plugins, this_machine=False)
    return plan_run(config, plugins, BUILT_IN["h200"])


def test_compiled_kernels_cost_the_compiled_rate_and_eager_ops_the_eager_one():
    rates = dataclasses.replace(
        BUILT_IN["h200"], host_op_seconds=1e-5, compiled_op_host_seconds=5e-5
    )
    assert rates.host_seconds(10, 4) == pytest.approx(6 * 1e-5 + 4 * 5e-5)
    # a calibration saved before the rate was measured: an eager op's cost stands in
    unmeasured = dataclasses.replace(rates, compiled_op_host_seconds=0.0)
    assert unmeasured.host_seconds(10, 4) == pytest.approx(10 * 1e-5)


def test_a_compiled_plan_counts_its_layers_kernels_as_compiled_and_an_eager_one_none():
    compiled, eager = _plan(), _plan("--no-compile")
    for work in (compiled.stages[0].profile.forward, compiled.stages[0].profile.backward):
        assert 0 < work.compiled_ops <= work.ops
    for work in (eager.stages[0].profile.forward, eager.stages[0].profile.backward):
        assert work.compiled_ops == 0
    # this small model's step is its host's: at the compiled rate, slower than its GPU's
    assert compiled.step_seconds > _plan("--cuda-graph-impl", "local").step_seconds


def test_a_graphed_run_is_planned_at_an_eager_ops_rate():
    graphed = _plan("--cuda-graph-impl", "local")
    assert graphed.rates.compiled_op_host_seconds == 0.0
    assert _plan().rates.compiled_op_host_seconds == BUILT_IN["h200"].compiled_op_host_seconds


def test_the_built_in_rate_is_what_its_result_files_give():
    """The H200's rate: the 1.3B GPT's DP rank at 12 and 24 layers, step times from the runs'
    result files, kernels from the planner's own count of the same commands."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compiled_host_rate import rates

    def dp_rank(name: str) -> dict:
        result = json.loads((RESULTS / name).read_text())
        result["results"] = [r for r in result["results"] if r["layout"] == "tp1dp2"]
        return result

    names = ["host_1p3b_L12_mb1_2026-12-01.json", "host_1p3b_mb1_2026-12-01.json"]
    (row,) = rates(dp_rank(names[0]), dp_rank(names[1]), names)
    built_in = BUILT_IN["h200"].compiled_op_host_seconds
    assert row["compiled_op_host_seconds"] == pytest.approx(built_in, rel=0.005)
    recorded = json.loads((RESULTS / "compiled_host_h200_2026-12-01.json").read_text())
    first = recorded["results"][0]
    assert (first["layout"], first["sources"]) == ("tp1dp2", names)
    assert first["compiled_op_host_seconds"] == pytest.approx(row["compiled_op_host_seconds"])


def test_the_rate_script_refuses_unpaired_or_missing_files(tmp_path):
    import subprocess

    script = str(ROOT / "benchmarks" / "compiled_host_rate.py")
    shallow = str(RESULTS / "host_1p3b_L12_mb1_2026-12-01.json")
    for args, culprit in (([shallow], "in pairs"), ([shallow, "nowhere.json"], "nowhere.json")):
        done = subprocess.run(
            [sys.executable, script, *args, "--out", str(tmp_path)], capture_output=True, text=True
        )
        assert done.returncode == 2 and culprit in done.stderr.splitlines()[-1]
        assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())
