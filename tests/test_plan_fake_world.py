"""The planner without communication against one rank alone on one H200 over torch's fake process
group (``parallel_layouts.py --fake-world``: no collective moves anything), with the built-in
H200 rates and every collective free (``Rates.without_communication``). It separates what the
planner misses inside a rank (compute, its host's launches, syncs) from what it misses between
ranks: a layout planned right here and wrong on several GPUs is wrong in its communication.

Step time within 15%, peak memory within 10%. What it showed on 2026-11-29: data-parallel GPT
ranks within 5% (0.99-1.05x); the rest planned fast, the misses below as strict xfails with
their numbers. A TP2 rank ran 1.28x its plan (TP2 + SP 1.33x): most of TP2's miss on two GPUs
(planned +30% in test_plan_recorded) is inside the rank, not in its collectives. Peaks within
10% but for drop-and-pad EP2 (+18%).

Since 2026-12-01 the host's time per kernel of a compiled layer is measured
(``Rates.compiled_op_host_seconds``, benchmarks/compiled_host_rate.py: 60.8 us a counted kernel,
where an eager op costs 8.5) and the TP rows are planned as they ran (``--tp-comm-overlap`` on by
default): the TP2 and TP2 + SP ranks at micro-batch 4 went from 1.24x and 1.31x to 1.04x and
1.00x, the CP4 rank at micro-batch 1 from 1.27x to 1.05x.

Until 2026-12-01 (session 60) the fake group's stand-ins for the functional collectives that
compiled layers trace (benchmarks/fake_rank.py) copied into the collectives' outputs; compiled on
a GPU that copy was lost, and the gradients through the gathers and reduce-scatters were the
collectives' unwritten buffers (zeros; tests/test_gpu_fake_rank.py). An allgather EP2 rank of
the MoE ran 142.9 ms with a 23.4 GiB peak that way, part of its backward compiled away; fixed,
171.6 ms and 31.8 GiB, its first gradient norm as eager's. The rows below from before the fix
whose compiled layers trace those stand-ins (sequence parallelism's gathers, the EP2 rows'
dispatch, flex) are kept as they were planned; session 62 re-measured them (the ``_s62`` files).

Since session 62 the experts' grouped GEMM is planned on every row its dispatcher hands it, as
the GPU runs it (``mega.parallel.expert.filled_rows``: FLOPs for the rows the groups fill,
memory for all), and their SwiGLU as the GPU's op (``swiglu_rows``, which keeps the fc1 output
and its own output for backward). The allgather EP4 rank had been planned at 24.9 GiB against
33.0 (-25%; flex 22.7 against 30.8), its experts' activations a quarter of what the GPU keeps;
now 34.2 and 32.0 (+4%, as the DP ranks' +4%). Their steps are planned within 7% (the SwiGLU is
counted on every row, where the GPU's kernel returns past the filled ones). The MoE DP ranks
still run 1.12-1.24x their plans: their GPU's side (the routing's kernels, the router's fp32
GEMMs) is what misses.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from test_plan_recorded import train_flags

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
GIB = 2**30
EP2_S60 = "ep2dp2@MEGA_PLUGINS_DIR=/work/main/benchmarks/plugins@MEGA_MEMORY_PEAK=/root/out/ep2"
FLEX = "--moe-token-dispatcher-type=flex"
ALLTOALL = "--moe-token-dispatcher-type=alltoall"
PADDED = f"{ALLTOALL} --moe-expert-capacity-factor=1.0 --moe-pad-expert-input-to-capacity"
ALLTOALL_MISS = (
    "alltoall rank {} ms, planned {} : the dispatch's host sync per layer and micro-batch (its"
    " counts read for the trips' splits), not modelled"
)
# (file, layout): None if its step is planned within 15%, else why not (a strict xfail). Rows with
# an environment setting (``@``: the ring's CUDA graphs, not planned) are left out, as are rows
# of code changed since (the dispatch-eager EP2 row of moe_ep2_fake_2026-11-29, the allgather
# EP2 rows with a host sync: moe_fake_router_stats' EP2 row, 193.3 ms, was also measured with
# the broken stand-ins, see the module docstring).
ROWS = {
    # MoE DP ranks: the routing's kernels below their bytes' rate, the router's fp32 GEMMs and
    # host-bound runs (moe_dp2_fake_s56's profile) put them 1.12-1.24x over their plans
    ("moe_ep2_fake_traced_trips_2026-11-29", "tp1dp2"): None,
    ("moe_ep2_fake_traced_trips_2026-11-29", "ep2dp2"): "EP2 rank 190.9 ms, planned 159.5"
    " (1.20x): also the alltoall dispatch's host sync per layer and micro-batch, not modelled",
    ("moe_ep4_fake_traced_trips_2026-11-29", "tp1dp4"): "MoE DP4 rank 179.5 ms, planned 144.9"
    " (1.24x): the DP ranks' miss (the routing's kernels, the router's fp32 GEMMs)",
    ("moe_ep4_fake_traced_trips_2026-11-29", "ep4dp4"): "EP4 rank 212.3 ms, planned 153.6"
    " (1.38x), as the EP2 rank",
    (
        "moe_ep2_fake_2026-11-29",
        "ep2dp2:--moe-expert-capacity-factor=1.0 --moe-pad-expert-input-to-capacity",
    ): None,  # run with the broken stand-ins (153.6 ms; re-measured in moe_ep2_fake_s62: 179.2)
    # session 56, after the accumulation kernel and PREMUL_SUM: the in-rank part of DP2's 1.22x
    # (moe_dp2_fake_s56's note: the memory-bound kernels 14.7 ms above their bytes' plan, the
    # routing's index, sort and scatter kernels among them; the router's fp32 GEMMs 3.7 counted
    # at the bf16 rate; host-bound runs of short kernels ~10 ms; 6.3 ms of the step are the fake
    # group's all-gather copies; the bf16 GEMMs ran 8 ms under their plan)
    ("moe_dp2_fake_s56_2026-12-01", "tp1dp2"): None,
    # session 57 (dd0e3c9): the same rank again, and the TP2 rank (their profiled twins, with
    # an ``@`` setting, left out)
    ("moe_dp2_fake_s57_2026-12-01", "tp1dp2"): None,
    ("tp_fake_s57_2026-12-01", "tp2dp1"): None,
    # the same rank after router_metrics took its ~400 launches a step out (3585e59): within 15%
    ("moe_fake_router_stats_2026-12-01", "tp1dp2"): None,
    ("moe_fake_router_stats_after_2026-12-01", "tp1dp2"): None,
    (
        "moe_fake_router_stats_2026-12-01",
        "tp1dp2:--moe-token-dispatcher-type=flex --cuda-graph-impl=local",
    ): None,
    # session 60, the fake group's stand-ins fixed (module docstring): the allgather EP2 rank
    # without its host sync (held_mixture, 55b6cea) beside DP2; the EP2 run's plugin records
    # one step's allocator history (step times are medians)
    ("moe_ep2_fake_s60_2026-12-01", "tp1dp2"): None,
    ("moe_ep2_fake_s60_2026-12-01", EP2_S60): None,
    ("tp_fake_mb4_2026-11-29", "tp1dp2"): None,
    # planned 1.24x and 1.31x fast until the compiled host rate (the module's docstring)
    ("tp_fake_mb4_2026-11-29", "tp2dp1"): None,
    ("tp_fake_mb4_2026-11-29", "tp2dp1-sp"): None,
    ("cp4_fake_16k_bf16_grads_2026-11-29", "tp1dp4-mb2"): None,
    ("cp4_fake_16k_bf16_grads_2026-11-29", "cp4-mb2"): None,
    # host-bound at 8 micro-batches of 4k tokens: planned 1.27x fast until the compiled host rate
    ("cp4_fake_16k_bf16_grads_2026-11-29", "cp4"): None,
    ("cp4_fake_32k_bf16_grads_2026-11-29", "tp1dp4"): None,
    ("cp4_fake_32k_bf16_grads_2026-11-29", "cp4"): None,
    ("cp4_fake_32k_bf16_grads_2026-11-29", "cp4-mb2"): None,
    # session 62 (ca5236d; the grouped GEMM planned on every row since, module docstring): the
    # 1.3B ranks re-measured with the stand-ins fixed, TP + SP compiled and eager
    ("tp_fake_s62_2026-12-02", "tp1dp2"): None,
    ("tp_fake_s62_2026-12-02", "tp2dp1"): None,
    ("tp_fake_s62_2026-12-02", "tp2dp1-sp"): None,
    ("tp_fake_s62_2026-12-02", "tp2dp1-sp:--no-compile"): "eager TP2 + SP rank 416.0 ms, planned"
    " 284.4 (1.46x): host-bound, the eager layer's Python around each of its 392 all-gathers a"
    " step (and the fake group's stand-in op at each, a cost of this instrument); not modelled",
    # the MoE's EP2 and EP4 ranks with every dispatcher beside their DP rank, one run each
    ("moe_ep2_fake_s62_2026-12-02", "tp1dp2"): None,
    ("moe_ep2_fake_s62_2026-12-02", "ep2dp2"): None,
    ("moe_ep2_fake_s62_2026-12-02", f"ep2dp2:{FLEX}"): None,
    ("moe_ep2_fake_s62_2026-12-02", f"ep2dp2:{ALLTOALL}"): ALLTOALL_MISS.format(221.3, 161.6),
    ("moe_ep2_fake_s62_2026-12-02", f"ep2dp2:{PADDED}"): None,
    ("moe_ep4_fake_s62_2026-12-02", "tp1dp4"): "MoE DP4 rank 88.2 ms, planned 74.6 (1.18x): the"
    " DP ranks' miss",
    ("moe_ep4_fake_s62_2026-12-02", "ep4dp4"): None,
    ("moe_ep4_fake_s62_2026-12-02", f"ep4dp4:{FLEX}"): None,
    ("moe_ep4_fake_s62_2026-12-02", f"ep4dp4:{ALLTOALL}"): ALLTOALL_MISS.format(96.0, 80.4),
}


def _run(name: str, layout: str) -> dict:
    runs = json.loads((RESULTS / f"{name}.json").read_text())["results"]
    return next(run for run in runs if run["layout"] == layout)


# the peaks planned more than 10% off
MEMORY_MISSES = {
    (
        "moe_ep2_fake_2026-11-29",
        "ep2dp2:--moe-expert-capacity-factor=1.0 --moe-pad-expert-input-to-capacity",
    ): "drop-and-pad EP2 planned at 29.88 GiB against 25.25 (+18%): run with the broken"
    " stand-ins, part of its compiled backward lost (its re-measurement, moe_ep2_fake_s62:"
    " 28.68 GiB, planned +4.2%)",
}


def _params(misses: dict) -> list:
    params = []
    for (name, layout), miss in misses.items():
        marks = pytest.mark.xfail(strict=True, reason=miss) if miss else ()
        params.append(pytest.param(name, layout, id=f"{name[:-11]}-{layout}", marks=marks))
    return params


_PLANS: dict[str, object] = {}


def _plan(run: dict):
    """The plan of a fake-world rank's command (``fake_rank.py train ...``), communication free;
    once per configuration (rows of several files ran the same one, each in its own run dir)."""
    words = shlex.split(run["command"])
    train = words[words.index("train") + 1 :]
    # recorded with --tp-comm-overlap on by default (planned without it until 2026-12-01)
    flags = train_flags(shlex.join(["-m", "mega", "train", *train]), False, True)
    argv = [*shlex.split(flags), "--nproc-per-node", str(run["world_size"]), "--device", "cuda"]
    key = shlex.join(argv)
    if key not in _PLANS:
        plugins = make_plugins()
        config = resolve_config(argv, plugins, this_machine=False)
        _PLANS[key] = plan_run(config, plugins, BUILT_IN["h200"].without_communication())
    return _PLANS[key]


@pytest.mark.parametrize(("name", "layout"), _params(ROWS))
def test_a_fake_world_rank_steps_within_15_percent_of_its_plan(name, layout):
    run = _run(name, layout)
    assert run["fake_world"]
    assert _plan(run).step_seconds * 1e3 == pytest.approx(run["step_ms"], rel=0.15)


@pytest.mark.parametrize(("name", "layout"), _params(dict.fromkeys(ROWS) | MEMORY_MISSES))
def test_a_fake_world_rank_peaks_within_10_percent_of_its_plan(name, layout):
    run = _run(name, layout)
    measured = max(run["peak_memory_gib_by_rank"])
    assert _plan(run).peak_bytes / GIB == pytest.approx(measured, rel=0.10)
