"""``mega plan`` of MoE models against the runs measured on GPUs, as test_plan_recorded.py checks
the GPT's, at issue 49's bounds: peak memory within 10% and tokens/s within 15%, with the
built-in rates of the GPU that ran them and the routing counted balanced (the runs' load-
balancing loss kept theirs near it: no token dropped, ``dropped_token_fraction`` 0).

- one H100 (``moe_throughput_2026-11-23.json``, its two mega rows) and one H200
  (``moe_throughput_h200_2026-11-29.json``, the same rows on later code): a 1.9B Mixtral-like
  model (12 layers, hidden 2048, 8 experts of ffn 2816, top-2), compiled, experts as one grouped
  GEMM or a loop over the experts;
- two H200 (``moe_scale_run_2gpu_2026-11-24.json``): a 2.7B one (ffn 4096, seq 4096) at EP=2 x
  DP=2 with the ``alltoall`` dispatcher (compiled, the default then) and at TP=2 with SP (eager,
  the default with TP then).

Memory holds for all four (planned 42.43 GiB against 41.44, 43.70 against 42.30, 30.99 against
28.96 and 29.28, 51.87 against 52.40: +2.4%, +3.3%, +7.0%, -1.0%). Speed holds for the grouped
GEMM (planned 89.0 ms a step, measured 99.9: 92,019 tokens/s against 82,020, +12.2%; its
profile's GEMMs took 46.7 ms against 45.3 planned, the optimizer and gradient norm 22.6 against
23.0, its other kernels 20.4 against 10.8). The three misses are strict xfails (fixing them, or
breaking the rest, shows), each with what its record says about where the time went.

And the EP2 acceptance run on 2 H200 (``ACCEPTANCE``: DP2 and five EP2 dispatchers and
transports, compiled): memory holds for every row; speed is a strict xfail for every row.
"""

from __future__ import annotations

import json
import shlex

import pytest
from test_plan_recorded import RESULTS, train_flags

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

GIB = 2**30
ONE_GPU = {"h100": "moe_throughput_2026-11-23.json", "h200": "moe_throughput_h200_2026-11-29.json"}
TWO_H200 = "moe_scale_run_2gpu_2026-11-24.json"

SPEED_MISSES = {
    # The expert loop reads each layer's counts on the host (``counts.tolist()``): a sync and a
    # graph break per layer, whose specialised ints recompile the layer until dynamo's limit
    # leaves it eager. The profile's kernels sum to 97.8 ms of its 209.1 ms step (the grouped
    # GEMM's: 97.9 of 99.9): the GPU idles half the step waiting on the host, which the
    # planner's max(GPU, host launches) does not model. Planned 112.0 ms (73,152 tokens/s
    # against 39,187).
    "1gpu-h100-mega": "host syncs and recompiles of the expert loop (not modelled)",
    # The same two rows on one H200 on 2026-11-29 (c1068bd), after the loop's recompiles were
    # fixed (a81f5cb): the loop still idles its GPU (222.3 ms a step, 87.5 ms of kernels; planned
    # 2.32x fast); the grouped GEMM is GPU-bound (92.7 ms, kernels 88.4) and planned 16.4% fast
    # (102,925 tokens/s against 88,400; the H100's 12.2%). Its GEMMs, attention and optimizer
    # are planned within 9% (47.3, 8.5, 16.2 ms against 46.4, 7.9, 16.2); its other kernels
    # took 17.9 ms against 7.6 planned from their bytes (the H100's 20.4 against 10.8): the
    # routing's sorts, gathers and scatters run far below the bandwidth rate. Since the fused
    # kernels' reads of GEMM outputs and graph inputs are counted (fused_graph, 2026-11-29) the
    # grouped GEMM is planned at 101,061 tokens/s (+14.3%, within the bound; the H100's +9.6%).
    "1gpu-h200-mega": "the expert loop's host syncs (not modelled); planned 84,036 against 36,845",
    # Measured with the in-place c10d all-to-all that torch.compile mis-traced (docs/moe.md: its
    # gradient norms are not to be trusted; since replaced by functional collectives), the
    # alltoall dispatcher eager (torch.compiler.disable) with a host sync per layer for the
    # counts. Planned 188.9 ms a step (173,455 tokens/s against 66,351).
    "2gpu-h200-ep2dp2": "old mis-traced EP collectives; a host sync per layer (not modelled)",
    # Eager TP=2 + SP, as the GPT's tp2-sp (test_plan_recorded.SPEED_MISSES) but further off:
    # planned 326.3 ms a step (100,411 tokens/s against 42,274). No profile recorded.
    "2gpu-h200-tp2-sp": "eager TP + SP host time (as the GPT's tp2-sp miss); no profile",
}


def _one_gpu_rows() -> list:
    """(GPU kind, row) of mega's rows in each one-GPU file."""
    return [
        (kind, row)
        for kind, name in ONE_GPU.items()
        for row in json.loads((RESULTS / name).read_text())["results"]
        if row["system"].startswith("mega")
    ]


def _two_h200_runs() -> list:
    return json.loads((RESULTS / TWO_H200).read_text())["results"]


def _id(name: str) -> str:
    return name.replace(" --moe-grouped-gemm", "-grouped-gemm")


_PLANS: dict[str, object] = {}


def _plan_one_gpu(kind: str, row: dict):
    key = " ".join([kind, *row["argv"]])
    if key not in _PLANS:
        plugins = make_plugins()
        config = resolve_config(row["argv"], plugins, this_machine=False)  # --device cuda
        _PLANS[key] = plan_run(config, plugins, BUILT_IN[kind])
    return _PLANS[key]


def _plan_two_h200(run: dict):
    if run["command"] not in _PLANS:
        words = shlex.split(train_flags(run["command"]))
        # the checkpoint flags of the reshard sequence change nothing of a step
        for flag in ("--save", "--save-interval", "--load"):
            if flag in words:
                del words[words.index(flag) : words.index(flag) + 2]
        argv = [*words, "--nproc-per-node", str(run["world_size"]), "--device", "cuda"]
        plugins = make_plugins()
        config = resolve_config(argv, plugins, this_machine=False)
        _PLANS[run["command"]] = plan_run(config, plugins, BUILT_IN["h200"])
    return _PLANS[run["command"]]


def _params(kind: str, misses: dict[str, str] | None = None) -> list:
    misses = misses or {}
    if kind == "one":
        items = [
            (f"1gpu-{kind}-{_id(row['system'])}", (kind, row)) for kind, row in _one_gpu_rows()
        ]
    else:
        items = [(f"2gpu-h200-{run['layout']}", run) for run in _two_h200_runs()]
    return [
        pytest.param(
            item,
            id=key,
            marks=pytest.mark.xfail(strict=True, reason=misses[key]) if key in misses else (),
        )
        for key, item in items
    ]


@pytest.mark.parametrize("measured", _params("one"))
def test_one_gpu_moe_peak_memory_within_10_percent(measured):
    kind, row = measured
    plan = _plan_one_gpu(kind, row)
    assert plan.peak_bytes / GIB == pytest.approx(row["peak_memory_gib"], rel=0.10)


@pytest.mark.parametrize("measured", _params("one", SPEED_MISSES))
def test_one_gpu_moe_tokens_per_second_within_15_percent(measured):
    kind, row = measured
    assert _plan_one_gpu(kind, row).tokens_per_second == pytest.approx(
        row["tokens_per_s"], rel=0.15
    )


@pytest.mark.parametrize("run", _params("two"))
def test_two_h200_moe_peak_memory_of_every_rank_within_10_percent(run):
    plan = _plan_two_h200(run)
    assert len(plan.stages) == 1  # no pipeline: every rank is stage 0's position
    for measured in run["peak_memory_gib_by_rank"]:
        assert plan.peak_bytes / GIB == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("run", _params("two", SPEED_MISSES))
def test_two_h200_moe_tokens_per_second_within_15_percent(run):
    assert _plan_two_h200(run).tokens_per_second == pytest.approx(run["tokens_per_s"], rel=0.15)


# The MoE EP2 acceptance run on 2 H200 (c1c71fd, 2026-11-30, benchmarks/acceptance_runs.py's ep
# part): DP2 and five EP2 rows, compiled (the default since), each with its row's environment.
# Memory holds for all six. Speed is planned 24-64% fast for every row, DP2 included (104,878
# tokens/s per GPU against 80,009): in DP2's profile the compute stream took ~160 ms a step
# against 136 planned, with 47 ms of gradient reduce-scatters beside it (what they cost the GEMMs
# there is not modelled) and the routing's kernels below their bandwidth rate (as on one GPU).
# The EP rows' ratios to DP2 are nearer (flex planned 0.864x against 0.898x), so the base is
# what is off; alltoall's host sync per layer (0.727x measured) is not modelled either.
# Session 62: the experts' grouped GEMM planned on every row the dispatcher gives it, as the GPU
# runs it (mega.parallel.expert.filled_rows), and their SwiGLU as the GPU's op: the flex rows'
# memory from -6% to +4%, flex's speed from 1.17x to 1.15x (within 15%); the rows below miss.
ACCEPTANCE = "layouts_moe_2gpu_h200_acc_c1c71fd_2026-11-30.json"
ACCEPTANCE_MISSES = {
    "tp1dp2": "DP2 planned 1.30x fast (see ACCEPTANCE's comment)",
    "ep2dp2:--moe-token-dispatcher-type=alltoall": "planned 1.63x fast: DP2's miss and the"
    " dispatch's host sync per layer (not modelled)",
    "ep2dp2:--moe-token-dispatcher-type=flex@MEGA_FLEX_TRANSPORT=split": "planned 1.27x fast:"
    " NVSHMEM's exact splits, planned as NCCL's padded trips",
    "ep2dp2:--moe-token-dispatcher-type=flex --overlap-moe-expert-parallel-comm"
    "@MEGA_FLEX_OVERLAP_ON_GPUS=1": "planned 1.33x fast: the pipelined schedule's chunks"
    " (not planned: the meta layer runs the unpipelined one)",
    "ep2dp2:--moe-token-dispatcher-type=alltoall --moe-expert-capacity-factor=1.0"
    " --moe-pad-expert-input-to-capacity": "drop-and-pad planned 1.21x fast: DP2's miss",
}


def _acceptance_params() -> list:
    rows = json.loads((RESULTS / ACCEPTANCE).read_text())["results"]
    return [
        pytest.param(
            row,
            id=row["layout"],
            marks=[pytest.mark.xfail(strict=True, reason=ACCEPTANCE_MISSES[row["layout"]])]
            if row["layout"] in ACCEPTANCE_MISSES
            else [],
        )
        for row in rows
    ]


def _plan_acceptance(row: dict, monkeypatch: pytest.MonkeyPatch):
    env = row.get("env", {})  # the transport: rows of one command differ by it
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    key = " ".join([row["command"], *(f"{k}={v}" for k, v in sorted(env.items()))])
    if key not in _PLANS:
        words = shlex.split(train_flags(row["command"], tp_ran_eager=False))
        argv = [*words, "--nproc-per-node", str(row["world_size"]), "--device", "cuda"]
        plugins = make_plugins()
        config = resolve_config(argv, plugins, this_machine=False)
        _PLANS[key] = plan_run(config, plugins, BUILT_IN["h200"])
    return _PLANS[key]


@pytest.mark.parametrize("row", [pytest.param(*p.values, id=p.id) for p in _acceptance_params()])
def test_two_h200_moe_acceptance_peak_memory_within_10_percent(row, monkeypatch):
    plan = _plan_acceptance(row, monkeypatch)
    for measured in row["peak_memory_gib_by_rank"]:
        assert plan.peak_bytes / GIB == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("row", _acceptance_params())
def test_two_h200_moe_acceptance_tokens_per_second_within_15_percent(row, monkeypatch):
    plan = _plan_acceptance(row, monkeypatch)
    assert plan.tokens_per_second == pytest.approx(row["tokens_per_s"], rel=0.15)


# Session 54 on 2 H200 (85858c0): EP2 with --cuda-graph-impl local, flex over NCCL's padded trips
# and over peer-rows (only the real rows cross; the plan counts the padded blocks at NCCL's
# rate), and DP2 compiled beside them. The graphed EP2 rows are planned 4-9% fast (their
# step is the GPU's: no host skew to wait for) and within 10% of their memory (0.94x); DP2
# compiled and the graph-free EP2 rows of the same runs are planned 12-23% fast, DP2 outside
# the bound as in ACCEPTANCE above (a strict xfail here too).
# Session 55 (dac2958, 2026-12-01): the same pair after the gradient accumulation kernel and
# NCCL's PREMUL_SUM made DP2 5.3% faster: graphed EP2 planned 1.05x, DP2 1.24x. DP2's profile
# (340bbba) put the miss in three places: its backward grouped GEMMs ran 1.6-1.8x slower beside
# the overlapped reduce-scatters (~14 ms a step: a second wave of CTAs, sm_contention_2026-12-01),
# the router's fp32 GEMMs (N = 8 experts: 2.9 ms a step on FFMA kernels, counted at the bf16
# GEMM rate), and the routing's kernels below the bandwidth rate; none is modelled.
SESSION_54 = {
    "layouts_moe_2gpu_h200_peer_rows_swiglu_rows_2026-11-30.json": "r1",
    "layouts_moe_2gpu_h200_peer_rows_r2_2026-11-30.json": "r2",
    "layouts_moe_2gpu_h200_accum_premul_2026-12-01.json": "s55",
}
# Session 62 (the experts planned on every row, see ACCEPTANCE's comment): DP2 planned 1.20-1.23x
# fast, the graphed EP2 rows 1.01-1.05x (1.04-1.09x before).
SESSION_54_MISS = "DP2 compiled planned 20-23% fast (see the comments above)"


def _session_54_params() -> list:
    params = []
    for name, run in SESSION_54.items():
        for row in json.loads((RESULTS / name).read_text())["results"]:
            if row["layout"] == "tp1dp2":
                marks = pytest.mark.xfail(strict=True, reason=SESSION_54_MISS)
            elif "cuda-graph-impl" in row["layout"]:
                marks = ()
            else:
                continue  # graph-free EP2: 1.12-1.20x, the host's skew (not modelled)
            params.append(pytest.param(row, id=f"{run}-{row['layout']}", marks=marks))
    return params


@pytest.mark.parametrize("row", _session_54_params())
def test_two_h200_graphed_ep2_within_15_percent_speed_and_10_percent_memory(row, monkeypatch):
    plan = _plan_acceptance(row, monkeypatch)
    for measured in row["peak_memory_gib_by_rank"]:
        assert plan.peak_bytes / GIB == pytest.approx(measured, rel=0.10)
    assert plan.tokens_per_second == pytest.approx(row["tokens_per_s"], rel=0.15)
