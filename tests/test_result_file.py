"""benchmarks/result_file.py: every result file names the commit, device and versions it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def result_file(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import result_file

    yield result_file
    sys.modules.pop("result_file", None)


def test_a_result_records_where_it_came_from(result_file, monkeypatch, tmp_path):
    monkeypatch.setenv("MEGA_BENCH_COMMIT", "abc1234")  # a tree without .git, as on a GPU machine
    path = result_file.write_json(tmp_path, "demo", {"results": [1]})
    written = json.loads(path.read_text())
    assert path.name == f"demo_{written['date']}.json"
    assert written["commit"] == "abc1234" and written["results"] == [1]
    assert {"mega", "torch"} <= set(written["versions"]) and written["device"]


def test_a_result_goes_into_a_folder_not_yet_made(result_file, monkeypatch, tmp_path):
    # kernel_costs.py --out DIR with DIR missing lost its measurements to a FileNotFoundError
    monkeypatch.setenv("MEGA_BENCH_COMMIT", "abc1234")
    path = result_file.write_json(tmp_path / "new" / "dir", "demo", {"results": [2]})
    assert json.loads(path.read_text())["results"] == [2]


def test_a_scripts_own_fields_win_and_its_versions_gain_megas(result_file, monkeypatch):
    monkeypatch.setenv("MEGA_BENCH_COMMIT", "abc1234")
    own = {"command": "mega train ...", "versions": {"transformers": "4.57"}}
    merged = result_file.with_provenance(own)
    assert merged["command"] == "mega train ..." and merged["commit"] == "abc1234"
    assert merged["versions"]["transformers"] == "4.57" and "mega" in merged["versions"]


def test_every_script_that_writes_a_result_file_adds_the_provenance():
    # a script writing its own JSON result without it would record no commit (issue 51);
    # ab_trees.py records the commit of each of the two trees it compares (commit_of)
    writers = [
        p.name
        for p in BENCHMARKS.glob("*.py")
        if ".write_text(json.dumps(" in p.read_text() and p.name != "result_file.py"
    ]
    missing = [
        name
        for name in writers
        if not {"with_provenance", "write_json", "commit", "commit_of"}
        & set(_names(BENCHMARKS / name))
    ]
    assert writers and not missing, missing


def test_no_benchmark_script_edits_the_import_path():
    # scripts share code as siblings (Python puts a script's directory first on its path, under
    # torchrun too); a sys.path edit hid which mega a script measured (issue 51)
    editing = [p.name for p in BENCHMARKS.glob("*.py") if "sys.path" in p.read_text()]
    assert not editing, editing


def test_every_result_file_since_the_harness_records_where_it_came_from():
    # from 2026-11-28 on (issue 51): a number must lead to the commit, versions, device and
    # command that made it; hand-written summaries (profiles) included
    lacking = {}
    for path in sorted((BENCHMARKS / "results").glob("*.json")):
        record = json.loads(path.read_text())
        if str(record.get("date", "")) < "2026-11-28":
            continue
        versions = record.get("versions") or {}
        missing = [k for k in ("commit", "device", "command") if not record.get(k)]
        missing += [f"versions.{k}" for k in ("mega", "torch") if not versions.get(k)]
        if missing:
            lacking[path.name] = missing
    assert not lacking, lacking


def _names(path: Path) -> list[str]:
    import ast

    tree = ast.parse(path.read_text())
    imported = [
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    defined = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    return imported + defined


def test_a_result_file_renders_as_a_page_that_says_how_old_it_is(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import render_results

    rows = [{"layout": "tp1dp2", "tokens_per_s": 115131, "step_ms": 284.6, "lm_loss": [1.0]},
            {"layout": "tp2dp1-mb8", "tokens_per_s": 97559, "per_gpu_vs_tp1dp2": 0.8474}]  # fmt: skip
    path = tmp_path / "demo_2026-11-27.json"
    note = "TP2 at micro-batch 8 reaches 0.85x of DP2."
    path.write_text(
        json.dumps({"date": "2026-11-27", "commit": None, "note": note, "results": rows})
    )
    page = render_results.render(path).splitlines()
    assert note in page
    assert page[0] == "# demo_2026-11-27"
    assert "does not record the commit" in page[2]
    header = next(line for line in page if line.startswith("| layout"))
    assert header == "| layout | tokens_per_s | step_ms | per_gpu_vs_tp1dp2 |"
    assert "| tp2dp1-mb8 | 97,559 |  | 0.8474 |" in page
    assert page[-1] == "In the JSON only: `lm_loss`."
    # a commit this checkout does not have is said so, not taken for current
    assert "does not have" in render_results.freshness("0" * 40)


def test_a_trace_summary_splits_the_span_into_compute_nccl_both_and_idle(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trace_summary

    def kernel(name: str, ts: float, dur: float, tid: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid}

    # one step: a GEMM 0-100 us, NCCL 50-150 us on its own stream, idle 150-200, a GEMM 200-300
    trace = {"traceEvents": [kernel("gemm", 0, 100, 7), kernel("ncclDevKernel_AllGather", 50, 100, 21),
                             kernel("gemm", 200, 100, 7), {"ph": "X", "cat": "cpu_op", "name": "x",
                                                           "ts": 0, "dur": 999, "tid": 1}]}  # fmt: skip
    s = trace_summary.summarize(trace, steps=1)
    assert s["gpu_span_ms"] == pytest.approx(0.3) and s["compute_busy_ms"] == pytest.approx(0.2)
    assert s["nccl_busy_ms"] == pytest.approx(0.1) and s["nccl_beside_compute_ms"] == pytest.approx(
        0.05
    )
    assert s["idle_ms"] == pytest.approx(0.05)
    assert (
        s["streams"]["7"]["kernels"] == 2
        and s["nccl_kernels"]["ncclDevKernel_AllGather"]["per_step"] == 1
    )


def test_compute_kernels_rank_the_non_nccl_kernels_and_copies_by_time(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trace_summary

    def event(cat: str, name: str, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur, "tid": 7}

    # two steps: per step two GEMMs of 100 us, a copy of 300 us, an NCCL kernel (left out)
    events = [event("kernel", "gemm", 100), event("kernel", "gemm", 100)]
    events += [event("gpu_memcpy", "Memcpy DtoD", 300), event("kernel", "ncclDevKernel_x", 900)]
    events += [event("cpu_op", "aten::mm", 50)]  # host ops are not kernels
    kernels = trace_summary.compute_kernels({"traceEvents": events * 2}, steps=2, top=5)
    assert list(kernels) == ["Memcpy DtoD", "gemm"]
    assert kernels["gemm"] == {"per_step": 2, "ms": pytest.approx(0.2)}
    assert trace_summary.compute_kernels({"traceEvents": events}, steps=1, top=1) == {
        "Memcpy DtoD": {"per_step": 1, "ms": pytest.approx(0.3)}
    }


def test_idle_stretches_charge_each_wait_to_the_run_of_short_kernels_it_falls_in(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trace_summary

    def kernel(name: str, ts: float, dur: float, tid: int = 7) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid}

    # a GEMM 0-200; a routing run: topk 210-220, sort 250-260 (idle 10 + 30), then 40 idle
    # before the next GEMM 300-500; a norm run 500-510 right after it (no idle), GEMM 510-710;
    # NCCL on its own stream and a lone kernel on another stream are not the compute stream's
    events = [kernel("gemm", 0, 200), kernel("topk", 210, 10), kernel("sort", 250, 10)]
    events += [kernel("gemm", 300, 200), kernel("norm", 500, 10), kernel("gemm", 510, 200)]
    events += [kernel("ncclDevKernel_x", 0, 900, tid=21), kernel("other", 0, 5, tid=9)]
    runs = trace_summary.idle_stretches({"traceEvents": events}, steps=1)
    assert list(runs) == ["topk", "norm"]
    assert runs["topk"] == {
        "per_step": 1, "kernels_per_run": 2, "busy_ms": pytest.approx(0.02),
        "idle_ms": pytest.approx(0.08),
    }  # fmt: skip
    assert runs["norm"]["idle_ms"] == 0 and runs["norm"]["kernels_per_run"] == 1
    assert trace_summary.idle_stretches({"traceEvents": events}, steps=2, top=1) == {
        "topk": {"per_step": 0.5, "kernels_per_run": 2, "busy_ms": pytest.approx(0.01),
                 "idle_ms": pytest.approx(0.04)},
    }  # fmt: skip


def test_trace_skew_names_the_late_rank_and_splits_its_lateness_into_gpu_work_and_host(
    monkeypatch,
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trace_skew

    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    trip = "ncclDevKernel_SendRecv(x)"
    # rank 0: compute to 100, its trip starts at 100 (and spins); later it is the late one,
    # idle (its host behind) from 300 to 330 before its second trip
    rank0 = [kernel("gemm", 0, 100), kernel(trip, 100, 60), kernel("gemm", 200, 100)]
    rank0 += [kernel(trip, 330, 10)]
    # rank 1 (its clock base 1 ms later, so its ts are 1000 us smaller): compute to 140, idle
    # to 150, its trip at 150; its second trip at 300, right after its compute
    rank1 = [kernel("gemm", -1000, 140), kernel(trip, -850, 10), kernel("gemm", -800, 100)]
    rank1 += [kernel(trip, -700, 40)]
    traces = [
        {"traceEvents": rank0, "baseTimeNanoseconds": 0},
        {"traceEvents": rank1, "baseTimeNanoseconds": 1_000_000},
    ]
    row = trace_skew.skew(traces, steps=1)["ncclDevKernel_SendRecv"]
    assert row["matched"] == 2 and row["unmatched"] == 0
    assert row["last_count"] == [1, 1]
    assert row["waited_ms"] == [pytest.approx(0.05), pytest.approx(0.03)]
    # late by 50 (rank 1: 40 busy, 10 idle) then by 30 (rank 0: idle)
    assert row["late_gpu_busy_ms"] == pytest.approx(0.04)
    assert row["late_gpu_idle_ms"] == pytest.approx(0.04)


def test_host_ops_split_an_op_into_its_callees_and_its_own_time(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trace_summary

    def op(name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "ts": ts,
            "dur": dur,
            "pid": 0,
            "tid": tid,
        }

    # two steps; per step a ring call of 100 us holding two kernels' launches of 20 and 30 us,
    # and one add on another thread
    events = [op("ring", 0, 100), op("launch", 10, 20), op("launch", 40, 30), op("add", 0, 5, 2)]
    events += [{**e, "ts": e["ts"] + 1000} for e in events]
    ops = trace_summary.host_ops({"traceEvents": events}, steps=2)
    assert ops["ring"] == {"per_step": 1, "inclusive_ms": 0.1, "self_ms": pytest.approx(0.05)}
    assert ops["launch"]["per_step"] == 2 and ops["launch"]["self_ms"] == pytest.approx(0.05)
    assert ops["add"]["self_ms"] == pytest.approx(0.005)
    assert list(ops)[0] == "ring"  # by inclusive time


def test_callers_name_the_ops_around_each_call(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import trace_summary

    def op(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1}

    # one step: a graph call holding a node holding an item of 4 us; another item alone
    events = [op("graph", 0, 100), op("node", 10, 50), op("aten::item", 20, 4)]
    events += [op("aten::item", 200, 6)]
    found = trace_summary.callers({"traceEvents": events}, "aten::item", steps=1)
    assert found == {
        "node <- graph": {"per_step": 1, "ms": pytest.approx(0.004)},
        "(top level)": {"per_step": 1, "ms": pytest.approx(0.006)},
    }
