"""The planner against the compiled tensor-parallel layouts measured on 4 H100 (and 2 of them),
2026-11-27, issue 46's bounds: tokens/s within 15%, peak memory within 10%, with the built-in
H100 rates. The 1.3B GPT of benchmarks/parallel_layouts.py at global batch 32 (16 on 2 GPUs),
micro-batches sized so that a TP rank's GEMMs are as large as a DP rank's (8 at TP2, 16 at TP4).

Before a collective's latency was counted (``Rates.collective_latency_seconds``: 84 us, a 1 MiB
collective's time on these GPUs) these were planned 13-26% fast: a TP2 + SP layer launches 10
collectives per micro-batch, each planned at its bytes alone (a 32 MiB all-gather at 47 us
where it takes 140). TP2 x DP2 + SP at micro-batch 4 stays a known miss: there the host sets
the pace (a compiled TP2 + SP micro-batch took 122-137 ms on H100 pairs and 124-128 ms on an
H200 pair, the H200's faster GPU notwithstanding), and the host model (launches x one eager op's
cost) counts a fraction of it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
GIB = 2**30
# each file, and --tp-comm-overlap's default at its commit (a row that names the flag ran so)
FILES = {
    "layouts_1p3b_4gpu_h100_microbatch_2026-11-27.json": True,  # 187ccd8
    "layouts_1p3b_4gpu_h100_mb8_pp_no_overlap_2026-11-27.json": True,  # 187ccd8
    "layouts_1p3b_4gpu_h100_mb8_overlap_ab_2026-11-27.json": False,  # 57abc7c (reverted since)
    "layouts_1p3b_2gpu_h100_mb8_2026-11-27.json": False,  # 57abc7c
}
SPEED_MISSES = {
    "4gpu-tp2dp2-sp": "host-bound at micro-batch 4: planned 40,050 tokens/s per GPU against"
    " 23,756 measured (29,131 in a profiled run of the same day)",
}
RUN_FLAGS = {"--nproc-per-node", "--run-dir", "--train-iters", "--log-interval", "--master-port"}


def layout_argv(command: str, world_size: int, overlap_default: bool) -> list[str]:
    """The ``mega train`` flags of a recorded command less the run's own (ports, paths,
    iterations), with --tp-comm-overlap as it ran, for a CUDA machine of ``world_size`` GPUs."""
    words, kept, skip = shlex.split(command)[3:], [], False
    for word in words:
        if skip:
            skip = False
        elif word in RUN_FLAGS:
            skip = True
        else:
            kept.append(word)
    flag = "--tensor-model-parallel-size"
    tp = flag in kept and int(kept[kept.index(flag) + 1]) > 1
    if tp and not {"--tp-comm-overlap", "--no-tp-comm-overlap"} & set(kept):
        kept.append("--tp-comm-overlap" if overlap_default else "--no-tp-comm-overlap")
    return [*kept, "--nproc-per-node", str(world_size), "--device", "cuda"]


def _runs():
    params = []
    for name, overlap_default in FILES.items():
        gpus = name.split("_")[2]
        for run in json.loads((RESULTS / name).read_text())["results"]:
            key = f"{gpus}-{run['layout']}"
            argv = layout_argv(run["command"], run["world_size"], overlap_default)
            params.append(
                pytest.param(run, argv, key, id=f"{'_'.join(name.split('_')[4:-1])}-{key}")
            )
    return params


_PLANS: dict[str, object] = {}


def _plan(argv: list[str]):
    key = shlex.join(argv)
    if key not in _PLANS:
        plugins = make_plugins()
        config = resolve_config(argv, plugins, this_machine=False)
        _PLANS[key] = plan_run(config, plugins, BUILT_IN["h100"])
    return _PLANS[key]


# one test per row, so that each layout is planned once (the plans take most of the time)
@pytest.mark.parametrize(("run", "argv", "key"), _runs())
def test_tensor_parallel_layouts_within_15_percent_speed_and_10_percent_memory(run, argv, key):
    plan = _plan(argv)
    peak = max(stage.profile.peak_bytes for stage in plan.stages) / GIB
    assert peak == pytest.approx(max(run["peak_memory_gib_by_rank"]), rel=0.10)
    planned, measured = plan.tokens_per_second, run["tokens_per_s"]
    if key in SPEED_MISSES:  # still missed, and by more than the bound: fixing it shows here
        assert planned > 1.15 * measured, SPEED_MISSES[key]
    else:
        assert planned == pytest.approx(measured, rel=0.15)
