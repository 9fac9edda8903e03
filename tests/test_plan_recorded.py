"""The planner against the runs measured on GPUs (benchmarks/results): every recorded layout of
the 1.3B and 6.7B GPT on 1 and 2 H200 (data, tensor, sequence and pipeline parallel, interleaved,
micro-batch sizes, selective and full recompute, compiled and not), every pipeline stage's peak
memory within 10% and tokens/s within 20% with the built-in H200 rates; and the 1.3B and 2.7B GPT
in bf16 and FP8 on one H100 (benchmarks/gpt_throughput.py's mega rows) with the H100 rates. A
known miss is marked strict xfail, so that fixing it (or breaking the rest) shows; a record of
code since changed is skipped, saying what replaced it.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plugins.manager import make_plugins

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"
FILES = (
    "layouts_1p3b_1gpu_2026-11-24.json",
    "layouts_1p3b_2gpu_2026-11-24.json",
    "layouts_6p7b_2gpu_2026-11-24.json",
    "layouts_6p7b_2gpu_more_2026-11-24.json",
    "layouts_1p3b_2gpu_tp2_sp_2026-11-24.json",
)
# later runs of layouts recorded before, for code changed since: their ids end in "-again"
AGAIN = {"layouts_1p3b_2gpu_tp2_sp_2026-11-24.json"}
# one H100, benchmarks/gpt_throughput.py: its "mega" rows (bf16, and --fp8-format hybrid)
ONE_H100_FILES = (
    "gpt_fp8_1p3b_fused_gelu_2026-11-24.json",
    "gpt_fp8_2p7b_fused_gelu_2026-11-24.json",
)
GIB = 2**30
# Measured before full recompute kept its checkpoint outside the compiled layer: compiled around
# it, each 1.3B layer kept 288 MiB that the planner never counted (22.5 GiB against 17.3).
STALE = {
    "1p3b-2gpu-tp1dp2:--recompute-granularity=full": "measured with full recompute compiled "
    "around its checkpoint, since changed; its one-GPU twin (1p3b-1gpu) is checked instead",
}
# Sequence parallelism measured 35% slower than plain TP2 on the 1.3B (555.9 against 412.4 ms),
# with the same bytes communicated: its rank held a slice along dim 1 of [b, s, h], which cost a
# strided copy on both sides of every collective. It now holds a block of the flat tokens (no
# copy), and measured again on 2 H200 (the "-again" records) it is 0.94x TP2 (404.2 against
# 377.8 ms).
SPEED_STALE = {
    "1p3b-2gpu-tp2-sp": "measured before sequence parallelism held token blocks; measured "
    "again in layouts_1p3b_2gpu_tp2_sp (1p3b-2gpu-tp2-sp-again)",
}
MEMORY_MISSES: set[str] = set()
# Planned 24% fast (100,400 against 81,161 tokens/s) until each collective's latency was counted
# (Rates.collective_latency_seconds): SP launches twice TP2's collectives per layer. Now 2.5%.
SPEED_MISSES: set[str] = set()


# Every record here was made when --compile defaulted to off with tensor parallelism (it was
# refused there): a record that names neither gets --no-compile, what it ran with.
TP_RAN_EAGER = "--tensor-model-parallel-size"


def train_flags(command: str, tp_ran_eager: bool = True, overlap_default: bool = False) -> str:
    """The model and layout flags of a recorded ``python -m mega train`` command, with
    ``--no-compile`` where it ran eager by the default of its day (``tp_ran_eager``:
    TP_RAN_EAGER), and ``--no-tp-comm-overlap`` where it ran before the overlap was on by
    default (unless ``overlap_default``: recorded since)."""
    words = shlex.split(command)[3:]
    tp = int(words[words.index(TP_RAN_EAGER) + 1]) if TP_RAN_EAGER in words else 1
    given = "--compile" in words or "--no-compile" in words
    if tp_ran_eager and tp > 1 and not given:
        words.append("--no-compile")
    # and before --tp-comm-overlap existed (on by default with TP since): the layers' own backward
    overlap = "--tp-comm-overlap" in words or "--no-tp-comm-overlap" in words
    if tp > 1 and not overlap and not overlap_default:
        words.append("--no-tp-comm-overlap")
    if str(BENCHMARKS) not in sys.path:  # the recorded commands' parsing is the scripts' own
        sys.path.insert(0, str(BENCHMARKS))
    from recorded_command import without_run_flags

    return shlex.join(without_run_flags(words))


def _runs(misses: set[str], stale: dict[str, str] | None = None):
    stale = {**STALE, **(stale or {})}
    params = []
    for name in FILES:
        for run in json.loads((RESULTS / name).read_text())["results"]:
            model, gpus = name.split("_")[1:3]
            key = f"{model}-{gpus}-{run['layout'].split(' ')[0]}"
            key += "-again" if name in AGAIN else ""
            if key in stale:
                mark = pytest.mark.skip(reason=stale[key])
            elif key in misses:
                mark = pytest.mark.xfail(strict=True, reason="known miss")
            else:
                mark = ()
            params.append(pytest.param(run, id=key, marks=mark))
    return params


_PLANS: dict[str, object] = {}


def _plan(run: dict):
    if run["command"] not in _PLANS:
        plugins = make_plugins()
        argv = [
            *shlex.split(train_flags(run["command"])),
            "--nproc-per-node",
            str(run["world_size"]),
        ]
        _PLANS[run["command"]] = plan_run(resolve_config(argv, plugins), plugins, BUILT_IN["h200"])
    return _PLANS[run["command"]]


@pytest.mark.parametrize("run", _runs(MEMORY_MISSES))
def test_peak_memory_of_every_stage_within_10_percent(run):
    plan = _plan(run)
    world, by_rank = run["world_size"], run["peak_memory_gib_by_rank"]
    for stage in plan.stages:
        measured = by_rank[stage.stage * (world // len(plan.stages))]
        assert stage.profile.peak_bytes / GIB == pytest.approx(measured, rel=0.10), stage.stage


@pytest.mark.parametrize("run", _runs(SPEED_MISSES, SPEED_STALE))
def test_tokens_per_second_within_20_percent(run):
    assert _plan(run).tokens_per_second == pytest.approx(run["tokens_per_s"], rel=0.20)


def test_measured_fastest_6p7b_layout_is_predicted_fastest():
    # the acceptance of --search on the recorded layouts: ranked by predicted tokens/s, the
    # one measured fastest comes first (all fit 2 H200)
    runs = [
        run
        for name in FILES
        if "6p7b" in name
        for run in json.loads((RESULTS / name).read_text())["results"]
    ]
    measured = max(runs, key=lambda run: run["tokens_per_s"])
    predicted = max(runs, key=lambda run: _plan(run).tokens_per_second)
    assert predicted["layout"] == measured["layout"]


def _one_h100_runs():
    params = []
    for name in ONE_H100_FILES:
        for row in json.loads((RESULTS / name).read_text())["results"]:
            if row["system"].startswith("mega"):
                precision = "fp8" if "--fp8-format" in row["argv"] else "bf16"
                params.append(pytest.param(row, id=f"{name.split('_')[2]}-1gpu-h100-{precision}"))
    return params


@pytest.mark.parametrize("row", _one_h100_runs())
def test_one_h100_bf16_and_fp8_runs_within_10_percent_memory_and_20_percent_speed(row):
    plugins = make_plugins()
    config = resolve_config(row["argv"], plugins, this_machine=False)  # --device cuda
    plan = plan_run(config, plugins, BUILT_IN["h100"])
    assert plan.stages[0].profile.peak_bytes / GIB == pytest.approx(
        row["peak_memory_gib"], rel=0.10
    )
    assert plan.tokens_per_second == pytest.approx(row["tokens_per_s"], rel=0.20)


# 2 H100 (NVLink), 2026-11-27, compiled TP layouts (functional collectives, no RNG-fork graph
# breaks), global batch 8 at micro-batch 4. Counting each collective's latency besides its bytes
# (a 32 MiB all-gather: 0.14 ms, not the 0.05 its bytes alone take) brought TP2 within 12%
# (planned 1.24x before). TP2 + SP stays planned 1.47x fast: at micro-batch 4 its step is
# host-bound (tests/test_plan_tp_h100.py's docstring), which the host model does not count.
MULTI_H100_FILES = ("layouts_1p3b_2gpu_compiled_rngfix_2026-11-27.json",)
MULTI_H100_SPEED_MISSES = {"tp2dp1-sp"}


def _multi_h100_runs(misses: set[str]):
    params = []
    for name in MULTI_H100_FILES:
        for run in json.loads((RESULTS / name).read_text())["results"]:
            layout = run["layout"]
            mark = pytest.mark.xfail(strict=True, reason="known miss") if layout in misses else ()
            params.append(pytest.param(run, id=f"1p3b-2gpu-h100-{layout}", marks=mark))
    return params


def _plan_h100(run: dict):
    flags = train_flags(run["command"], tp_ran_eager=False)  # compiled by default since
    argv = [*shlex.split(flags), "--nproc-per-node", str(run["world_size"])]
    plugins = make_plugins()
    config = resolve_config([*argv, "--device", "cuda"], plugins, this_machine=False)
    return plan_run(config, plugins, BUILT_IN["h100"])


@pytest.mark.parametrize("run", _multi_h100_runs(MULTI_H100_SPEED_MISSES))
def test_two_h100_compiled_layouts_speed_within_20_percent(run):
    assert _plan_h100(run).tokens_per_second == pytest.approx(run["tokens_per_s"], rel=0.20)


@pytest.mark.parametrize("run", _multi_h100_runs(set()))
def test_two_h100_compiled_layouts_memory_within_10_percent(run):
    peak = max(stage.profile.peak_bytes for stage in _plan_h100(run).stages) / GIB
    assert peak == pytest.approx(run["max_memory_gb_per_gpu"], rel=0.10)


# 2 H200, 2026-11-27, planned as they ran (compiled by default, CP eager by default, each file's
# commit). The 1.3B GPT at 16k, CP2 (the ring of one cuDNN call per step) against DP2, checked at
# issue 47's bounds: 15% tokens/s, 10% peak memory. Planned 28,911 tokens/s per GPU and 32.45
# GiB against 30,412 and 32.52. Before the planner ran the ring's blocks as the fused kernel (on
# meta they took the float32 math path: [sq, sk] scores, no attention FLOPs) and counted the
# ring's transfers, it planned CP2 at 7,308 tokens/s per GPU and 44.08 GiB.
# DP2 at 16k planned 16% slow (33,532 against 40,161) while the attention rates were calibrated
# at 2,048 positions only: on one H100 the DP2 step's cuDNN attention took 360 ms
# (cp2_16k_profile_h100_2026-11-27) where those rates give 636 ms (see below for today's).
# layouts_1p3b_16k_cp2_h100_before_ring_rewrite_2026-11-27 is not checked: it measured the ring
# before its rewrite (one call per block, flash kernels, 20,452 tokens/s per GPU).
# 2026-11-28 (commit 2b00d94): CP compiled by default, the ring's backward on its own block last;
# planned CP2 at 33,640 tokens/s per GPU and 30.36 GiB against 34,713 and 29.63 measured,
# all_gather 30,583 and 31.11 against 29,914 and 30.38. (Those CP2 plans were near only because
# two misses cancelled: attention planned slow at 16k, the ring's merges and accumulators not
# counted. 2026-11-29: CP2 40,930 against 34,713, all_gather 34,168 against 29,914.)
CP_FILES = (
    "layouts_1p3b_16k_cp2_h200_ring_cudnn_2026-11-27.json",
    "layouts_1p3b_16k_cp2_h200_compiled_default_2026-11-28.json",
    "layouts_1p3b_16k_4gpu_h200_cp_2026-11-28.json",
    "layouts_1p3b_32k_4gpu_h200_cp_2026-11-28.json",
)
# DP at 16k and 32k planned 15-25% slow while the attention rates were the 2,048-position ones
# for every length; with the rates by sequence length (plan_calibration_attention_length_h200,
# 2026-11-29) DP is planned within 2-5% at 16k and 32k. The same day the ring's merges and
# accumulators were counted as the unfused work they are, and the fused weight gradient as the
# GPU runs it (one fp32-output GEMM; on meta it had taken the CPU's path, two float32 copies of
# its operands). With those three corrections the CP rows are planned 14-89% fast: the CP2 rows
# had been within 15% because the slow attention cancelled what the planner does not see. What
# it does not see, measured:
# - CP2 at 16k, compiled (cp2_16k_profile_2026-11-28): other kernels 161 ms a step against
#   DP2's 74 (the ring's copies, cuDNN's per-call backward helpers, the accumulators), 68 ms idle
#   (37 of them waiting on the forward's block);
# - CP4: a rank runs 8 micro-batches of 4k tokens where a DP4 rank runs 2 of 16k, and is
#   host-bound: alone on one H200 over a fake process group it took 1,109-1,139 ms a step with
#   its GPU busy 932 ms (cp4_fake_16k_2026-11-29), and in the real ring 1,600-1,940 ms, the
#   ranks waiting on one another's hosts (cp4_16k_ring_timeline_fused_merge_2026-11-28). The
#   planner's host model (one eager op's cost per launch) and its ring model (transfers beside
#   the attention) see neither;
# - a2a: its layer was counted eager until 2026-11-29 (its chunk order, an index tensor cached
#   per device, failed in the trace on meta; now a stack of slices): planned +18% then, +25%
#   measured compiled, as the other host-bound CP4 rows;
# - CP2 of 2026-11-27 was measured with that day's ring (eager, before the one-pass merge).
# The CP4 plans are of today's ring (backward's accumulators in bf16 since 2026-11-29, f68aadc),
# the runs of the float32 ones (twice the backward's bytes sent): the plans moved 2-3% faster.
# The ring's transfers are planned at the point-to-point rate measured on 4 H200 (168.4 GB/s,
# plus the collective latency per transfer; collectives_ring_4gpu_h200_2026-11-28) since
# 2026-11-29, not at the all-reduce bus rate (360 GB/s, assumed), which planned the measured
# transfers at a third of their time: CP4 at 16k went from +95% to +68%; the other rows moved
# less than 0.2% (their attention outlasts the slower transfers).
CP_SPEED_MISSES = {
    "1p3b-16k-2gpu-h200-cp2@2026-11-27": "planned 80,079 tokens/s against 60,824 (+32%)",
    "1p3b-16k-2gpu-h200-cp2@2026-11-28": "planned 80,079 tokens/s against 69,426 (+15.3%)",
    "1p3b-16k-4gpu-h200-cp2dp2": "planned 160,342 tokens/s against 138,335 (+16%)",
    "1p3b-16k-4gpu-h200-cp4": "planned 124,636 tokens/s against 81,672 (+53%)",
    "1p3b-16k-4gpu-h200-cp4:--cp-comm-type=a2a": "planned 127,157 against 106,747 (+19%)",
    "1p3b-32k-4gpu-h200-cp4": "planned 111,850 tokens/s against 87,254 (+28%)",
}
# The all_gather CP4 row was planned +28% until the host's time per compiled kernel was measured
# (2026-12-01, Rates.compiled_op_host_seconds: its rank is host-bound at 8 micro-batches of 4k
# tokens); now +2.7%. The p2p and a2a CP4 rows moved 8 and 5 points with it.
# --tp-comm-overlap against its absence, TP2 and TP2 + SP, one run (rows that name the flag ran
# with it; the others ran without it, the default of that commit), global batch 8 at micro-batch
# 4: host-bound, as the H100 TP2 + SP row above. Planned 1.22x to 1.41x the measured tokens/s
# (1.37x to 1.73x before collective latency was counted): strict xfails with the numbers. With
# the fused kernels' reads of GEMM outputs counted (2026-11-29) TP2 with the overlap is planned
# at 46,139 against 39,570 (+16.6%), within this test's 20%; the others 1.24x to 1.40x.
TP_AB_FILES = ("layouts_1p3b_2gpu_h200_tp_comm_overlap_ab_2026-11-27.json",)
TP_AB_SPEED_MISSES = {
    "1p3b-2gpu-h200-tp2dp1": "planned 95,689 tokens/s against 75,466 (+27%)",
    "1p3b-2gpu-h200-tp2dp1-sp": "planned 87,532 against 64,127 (+36%)",
}
# TP2 + SP with the overlap: +24% until the compiled host rate (2026-12-01), +17.9% since. The
# two rows above ran without the overlap and are planned with it off: their compiled layers'
# GPU time outlasts the host's there, and what they miss is between the ranks.


def _h200_runs(files: tuple[str, ...], misses: dict[str, str]):
    params = []
    for name in files:
        seq = next((f"-{n}" for n in ("16k", "32k") if f"_{n}_" in name), "")
        prefix = f"1p3b{seq}-{'4gpu' if '_4gpu_' in name else '2gpu'}-h200"
        for run in json.loads((RESULTS / name).read_text())["results"]:
            key = f"{prefix}-{run['layout']}"
            reason = misses.get(f"{key}@{name[-15:-5]}", misses.get(key))  # one file's, or all
            marks = pytest.mark.xfail(strict=True, reason=reason) if reason else ()
            params.append(pytest.param(run, id=f"{key}@{name[-15:-5]}", marks=marks))
    return params


_H200_PLANS: dict[str, object] = {}


def _plan_h200(run: dict):
    if run["command"] not in _H200_PLANS:
        flags = train_flags(run["command"], tp_ran_eager=False)  # compiled by default then
        argv = [*shlex.split(flags), "--nproc-per-node", str(run["world_size"]), "--device", "cuda"]
        plugins = make_plugins()
        config = resolve_config(argv, plugins, this_machine=False)
        _H200_PLANS[run["command"]] = plan_run(config, plugins, BUILT_IN["h200"])
    return _H200_PLANS[run["command"]]


def _peak_gib(plan) -> float:
    return max(stage.profile.peak_bytes for stage in plan.stages) / GIB


@pytest.mark.parametrize("run", _h200_runs(CP_FILES, CP_SPEED_MISSES))
def test_h200_context_parallel_speed_within_15_percent(run):
    assert _plan_h200(run).tokens_per_second == pytest.approx(run["tokens_per_s"], rel=0.15)


@pytest.mark.parametrize("run", _h200_runs(CP_FILES, {}))
def test_h200_context_parallel_memory_within_10_percent(run):
    peak = max(run["peak_memory_gib_by_rank"])
    assert _peak_gib(_plan_h200(run)) == pytest.approx(peak, rel=0.10)


@pytest.mark.parametrize("run", _h200_runs(TP_AB_FILES, TP_AB_SPEED_MISSES))
def test_two_h200_tp_comm_overlap_speed_within_20_percent(run):
    assert _plan_h200(run).tokens_per_second == pytest.approx(run["tokens_per_s"], rel=0.20)


@pytest.mark.parametrize("run", _h200_runs(TP_AB_FILES, {}))
def test_two_h200_tp_comm_overlap_memory_within_10_percent(run):
    peak = max(run["peak_memory_gib_by_rank"])
    assert _peak_gib(_plan_h200(run)) == pytest.approx(peak, rel=0.10)
