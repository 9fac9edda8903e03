"""The planner against the 1.3B GPT's layouts with ``--cuda-graph-impl local`` on 2 H200
(2026-11-30, bded4f8, micro-batch 4 and 8), and the graph-free DP2 rows of the same runs, at
issue 46's bounds with the built-in H200 rates: tokens/s within 15%, peak memory within 10%.

Why these hold where the graph-free TP rows at micro-batch 4 do not (tests/test_plan_tp_h100.py's
known miss): the plan's step is the GPU's (its host model counts a launch per op at one eager
op's cost), and a graph-free TP step at micro-batch 4 is bound by its host at about 6 ms a layer
and micro-batch. Replayed as graphs, the step is the GPU's again. Planned when written: TP2 + SP
at micro-batch 4 0.93x of the measured tokens/s, TP2 0.98x, DP2 1.05x; at micro-batch 8
0.96x, 0.98x, 1.03x; peak memory 1.02-1.07x.
"""

from __future__ import annotations

import json

import pytest
from test_plan_tp_h100 import RESULTS
from test_plan_tp_h200 import check_h200_plan

FILES = (
    "layouts_1p3b_2gpu_h200_cudagraphs_mb4_2026-11-30.json",
    "layouts_1p3b_2gpu_h200_cudagraphs_mb8_2026-11-30.json",
    # session 52: the NCCL split under graphs (and DP2 beside it), and the copy-engine split
    # (its row alone; mega.core.plan.copy_engine: each block's transfer beyond the own block's
    # GEMM beside it; counted as the NCCL split, whole, it was planned 17% slow). That row ran
    # before the column-parallel backward went by the copy engine too: the plan of the code
    # that ran was 0.93x of it, of today's code 1.05x (its column backward's NCCL collectives,
    # counted whole before, now beside the GEMMs); the next 2-GPU session measures today's
    "layouts_1p3b_2gpu_h200_split_graphs_2026-11-30.json",
    "layouts_1p3b_2gpu_h200_copy_engine_graphs_only_2026-11-30.json",
    # session 53: DP2, TP2 and TP2 + SP with graphs, and TP2 + SP by the copy engine with its
    # column backward too, in one run
    "layouts_1p3b_2gpu_h200_copy_engine_one_run_2026-11-30.json",
    # TP2 without SP, its all-reduces by the copy engine (copy_engine_reduce): planned 0.99x
    "layouts_1p3b_2gpu_h200_tp2_copy_engine_2026-11-30.json",
)


def _runs() -> list:
    params = []
    for name in FILES:
        for run in json.loads((RESULTS / name).read_text())["results"]:
            graphs = "cuda-graph" in run["layout"]
            base = run["layout"].startswith("tp1dp2") and not graphs
            if (graphs and run["layout"].startswith("tp1dp2")) or not (graphs or base):
                continue  # DP2 with graphs is DP2's step; graph-free TP is the known miss
            micro = name.removeprefix("layouts_1p3b_2gpu_h200_").rsplit("_", 1)[0]
            env = "".join(f"-{value}" for value in run.get("env", {}).values())
            params.append(pytest.param(run, id=f"{micro}-{run['layout'].split(':')[0]}{env}"))
    return params


@pytest.mark.parametrize("run", _runs())
def test_graphed_layouts_within_15_percent_speed_and_10_percent_memory(run):
    check_h200_plan(run)
