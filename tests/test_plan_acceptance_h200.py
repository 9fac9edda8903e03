"""The planner against issue 46's and 47's acceptance runs on 2 H200 (2026-11-29, commit 26e2507,
``benchmarks/acceptance_runs.py --gpus 2``), at their bounds with the built-in H200 rates:
tokens/s within 15%, peak memory within 10%. Every layout ran compiled with ``--tp-comm-overlap``
on, the defaults. Each row's planned/measured ratio is in its id's entry below when it misses.

Planned within the bounds (speed, memory): DP2 1.08/1.05 and 1.07/1.07 (micro-batch 4, 8); TP2
1.01/1.03 and TP2 + SP 0.97/1.03 at micro-batch 8; the 6.7B's DP2 1.05/1.02, TP2 0.99/1.02, TP2 +
SP 0.97/1.02; at 16k DP2 1.04/1.07, CP2 p2p 1.13/1.03, all_gather 1.12/1.02, a2a 1.03/1.03 (speeds
since the fused kernels' reads of GEMM outputs are counted, 2026-11-29). The MoE's memory holds
(1.03-1.04); its speed does not (below).
"""

from __future__ import annotations

import json

import pytest
from test_plan_tp_h100 import GIB, RESULTS, layout_argv

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

FILES = {
    "layouts_1p3b_2gpu_h200_acc_mb4_2026-11-29.json": "1p3b",
    "layouts_1p3b_2gpu_h200_acc_mb8_2026-11-29.json": "1p3b",
    "layouts_6p7b_2gpu_h200_acc_2026-11-29.json": "6p7b",
    "layouts_1p3b_16k_2gpu_h200_acc_2026-11-29.json": "1p3b-16k",
    "layouts_moe_2gpu_h200_acc_2026-11-29.json": "moe",
}
# planned/measured tokens/s of the known misses (strict xfails: fixing one, or breaking the rest,
# shows). Micro-batch 4's TP ranks are host-bound (docs/performance.md): half a DP rank's GEMMs
# per micro-batch, twice its micro-batches, the same host time per micro-batch. Since 2026-12-01
# the planner's host model has the measured time per compiled kernel and plans such a rank alone
# within 4% (tests/test_plan_fake_world.py); what these rows still miss is between the ranks
# (each waits in its collectives for the other's host). The MoE's DP2 rank alone ran 1.18-1.26x
# its plan when these rows were measured, 1.14x since its log line's router statistics take a
# few kernels (tests/test_plan_fake_world.py): the routing's sorts, gathers and scatters run far
# below the bandwidth rate the planner gives them (tests/test_plan_moe_recorded.py), and the
# dropless dispatch's host sync per layer is not modelled.
SPEED_MISSES = {
    "1p3b-tp2dp1": "host-bound micro-batch 4, the ranks waiting on each other: planned 1.27x fast",
    "1p3b-tp2dp1-sp": "host-bound micro-batch 4, as TP2: planned 1.38x fast",
    "moe-tp1dp2": "routing kernels below the bandwidth rate: planned 1.29x fast",
    "moe-ep2dp2": "and a host sync per layer: planned 1.44x fast",
    "moe-ep2dp2:--moe-expert-capacity-factor=1.0 --moe-pad-expert-input-to-capacity": (
        "drop-and-pad: planned 1.24x fast"
    ),
}


def _runs(speed: bool) -> list:
    params = []
    for name, model in FILES.items():
        for run in json.loads((RESULTS / name).read_text())["results"]:
            if "error" in run:  # the ring-graphs row failed at start (fixed in 10fa16a)
                continue
            key = f"{model}-{run['layout']}"
            marks = ()
            if speed and key in SPEED_MISSES:
                marks = pytest.mark.xfail(strict=True, reason=SPEED_MISSES[key])
            params.append(pytest.param(run, id=key, marks=marks))
    return params


_PLANS: dict[str, tuple[float, float]] = {}


def _planned(run: dict) -> tuple[float, float]:
    """(tokens/s, the largest stage's peak in GiB) planned for a recorded run, once per run."""
    if run["command"] not in _PLANS:
        argv = layout_argv(run["command"], run["world_size"], overlap_default=True)
        plugins = make_plugins()
        config = resolve_config(argv, plugins, this_machine=False)
        plan = plan_run(config, plugins, BUILT_IN["h200"])
        peak = max(stage.profile.peak_bytes for stage in plan.stages) / GIB
        _PLANS[run["command"]] = (plan.tokens_per_second, peak)
    return _PLANS[run["command"]]


@pytest.mark.parametrize("run", _runs(speed=False))
def test_acceptance_layouts_peak_memory_within_10_percent(run: dict):
    assert _planned(run)[1] == pytest.approx(max(run["peak_memory_gib_by_rank"]), rel=0.10)


@pytest.mark.parametrize("run", _runs(speed=True))
def test_acceptance_layouts_tokens_per_second_within_15_percent(run: dict):
    assert _planned(run)[0] == pytest.approx(run["tokens_per_s"], rel=0.15)
