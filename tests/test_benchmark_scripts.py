"""The GPU benchmark scripts run end to end on the CPU at toy size (``--device cpu``), so that a
broken script is found here rather than on leased GPU time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega.testing.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]


def _report(command: list[str], out: Path, name: str) -> dict:
    """Run a benchmark's ``command``; the one result file it wrote in ``out`` (``name_<date>``)."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = out.glob(f"{name}_*.json")
    return json.loads(result.read_text())


def test_gpt_throughput_smoke_run_on_the_cpu(tmp_path: Path):
    command = [
        sys.executable, str(ROOT / "benchmarks" / "gpt_throughput.py"), "--device", "cpu",
        "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32", "--vocab", "128",
        "--mbs", "2", "--gbs", "4", "--warmup", "4", "--iters", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("gpt_throughput_*.json")
    report = json.loads(result.read_text())
    systems = [row["system"] for row in report["results"]]
    assert systems == ["reference-bf16", "reference-fp32-master", "mega"]
    # the same initial weights, batches and schedule: mega and the fp32-master reference agree
    assert report["summary"]["mega vs reference-fp32-master"]["loss_rel_diff"] < 1e-3
    mega = report["results"][-1]
    assert abs(mega["iteration_line_tflops_vs_benchmark"] - 1) < 0.5


def test_quickstart_speed_reads_its_own_iteration_lines(tmp_path: Path):
    command = [sys.executable, str(ROOT / "benchmarks" / "quickstart_speed.py"), "--iters", "21"]
    proc = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("quickstart_speed_*.json")
    (row,) = json.loads(result.read_text())["results"]
    assert row["last_iteration"] == 21
    # tokens/s is the quickstart's global batch of 16 x 128 tokens over the measured step time
    assert abs(row["tokens_per_s"] - 16 * 128 / (row["step_ms"] / 1000.0)) < 1.0
    assert float(row["lm_loss"]) < 5.6  # below ln(256): it trained


def test_bert_throughput_smoke_run_on_the_cpu(tmp_path: Path):
    """mega (through its third-party-style synthetic dataset) and one Hugging Face system; the
    compiled ones take a minute each on a CPU and run the same code."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bert_throughput.py"), "--device", "cpu",
        "--systems", "hf-fp32-autocast,mega", "--layers", "1", "--hidden", "32", "--heads", "2",
        "--seq", "32", "--vocab", "256", "--mbs", "2", "--gbs", "4", "--warmup", "4",
        "--iters", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    report = _report(command, tmp_path, "bert_throughput")
    hf, mega = report["results"]
    assert (hf["system"], mega["system"]) == ("hf-fp32-autocast", "mega")
    assert report["summary"]["fastest_hf"] == "hf-fp32-autocast"
    # both start near ln(V) + ln(2): the masked-LM loss of uniform logits plus the binary one
    assert abs(mega["first_loss"] + mega["last_iteration_line"]["sop_loss"] - 6.24) < 0.5
    assert abs(hf["first_loss"] - 6.24) < 0.5


def test_t5_throughput_smoke_run_on_the_cpu(tmp_path: Path):
    command = [
        sys.executable, str(ROOT / "benchmarks" / "t5_throughput.py"), "--device", "cpu",
        "--systems", "hf-fp32-autocast,mega,mega-original", "--layers", "1", "--hidden", "32",
        "--heads", "2", "--ffn", "64", "--seq", "32", "--dec-seq", "16", "--vocab", "256", "--mbs", "2",
        "--gbs", "4", "--warmup", "4", "--iters", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("t5_throughput_*.json")
    hf, mega, original = json.loads(result.read_text())["results"]
    assert (hf["system"], mega["system"]) == ("hf-fp32-autocast", "mega")
    assert "--relu" in original["argv"] and "relative" in original["argv"]
    # random labels over 256 ids: all start near ln(256) = 5.55
    for row in (mega, original):
        assert abs(row["first_loss"] - 5.55) < 0.5
    assert abs(hf["first_loss"] - 5.55) < 1.0


def test_parallel_layouts_with_context_parallelism_on_the_cpu(tmp_path: Path):
    """The long-context comparison (CP=2 against DP=2) at toy size on gloo: the script runs a
    CP layout, its bf16 losses within bf16 rounding of DP=2's (a missing reduction or a wrong mask
    moves a loss by far more). One comm type: the script treats them alike, and
    tests/test_context_parallel.py checks each against one process. A third row sets an
    environment variable for itself alone (``@NAME=VALUE``): a value mega refuses, so its row is
    that error line while the same layout without it ran. A fourth logs every second step: its
    losses are compared with the base's at the iterations both logged."""
    layouts = (
        "tp1dp2,cp2:--cp-comm-type=p2p,cp2:--cp-comm-type=p2p@MEGA_CP_RING_GRAPHS=maybe,"
        "tp1dp2:--log-interval=2"
    )
    command = [
        sys.executable, str(ROOT / "benchmarks" / "parallel_layouts.py"), "--layouts", layouts,
        "--base", "tp1dp2", "--iters", "6", "--warmup", "1", "--mbs", "1", "--gbs", "2",
        "--name", "long_context", "--out", str(tmp_path), "--model-flags",
        "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 64"
        " --max-position-embeddings 64 --device cpu --distributed-backend gloo"
        f" --master-port {free_port()}",  # tests side by side: not everyone on 29500
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("long_context_*.json")
    rows = json.loads(result.read_text())["results"]
    assert [row.get("error") for row in rows[:2]] == [None] * 2
    assert rows[1]["max_rel_loss_diff_vs_tp1dp2"] < 1e-2
    assert "MEGA_CP_RING_GRAPHS='maybe': must be 0 or 1" in rows[2]["error"]
    assert rows[2]["env"] == {"MEGA_CP_RING_GRAPHS": "maybe"} and "env" not in rows[1]
    assert rows[0]["iterations"] == [1, 2, 3, 4, 5, 6] and rows[3]["iterations"] == [1, 2, 4, 6]
    # iterations 1 and 2 are single steps on both rows (the same run): equal there, and the
    # interval means at 4 and 6 stay within bf16 rounding of a loss that barely moves
    assert rows[3]["lm_loss"][:2] == rows[0]["lm_loss"][:2]
    assert rows[3]["max_rel_loss_diff_vs_tp1dp2"] < 1e-2


def test_a_layouts_environment_must_be_name_equals_value():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from parallel_layouts import layout_env

    # two settings in a --layouts list, which commas split (a comma between settings once cut
    # the second off as a layout of its own)
    first, second = "cp4@A=1@B=x=y,cp2".split(",")
    assert layout_env(first) == ("cp4", {"A": "1", "B": "x=y"})
    assert layout_env(second) == ("cp2", {})
    assert layout_env("tp2dp1-sp:--tp-comm-overlap") == ("tp2dp1-sp:--tp-comm-overlap", {})
    with pytest.raises(SystemExit, match="'A' is not NAME=VALUE"):
        layout_env("cp4@A")


def test_a_fake_world_context_parallel_rank_trains_on_finite_numbers(tmp_path: Path):
    """``--fake-world`` (one rank's compute, on one GPU when no multi-GPU kind is lent): the fake
    group wrote nothing into the ring's receive buffers, so a CP rank computed on uninitialised
    memory and stopped at its first NaN gradient; they now hold the rank's own block."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "fake_rank.py"), "train", "--model", "gpt",
        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "64", "--max-position-embeddings", "64", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1",
        "--eval-iters", "0", "--attention-dropout", "0", "--nproc-per-node", "4",
        "--context-parallel-size", "4", "--cp-comm-type", "p2p", "--run-dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "lm_loss" in r] == [1, 2]


def test_the_ring_timeline_plugin_records_every_send_and_arrival(tmp_path: Path):
    """benchmarks/plugins/ring_timeline.py on gloo ranks (no CUDA events there: host times only):
    one row per send and per arrival of the step it records, from every rank."""
    from mega.testing import run_mega

    out = tmp_path / "timeline"
    env = {
        "MEGA_PLUGINS_DIR": str(ROOT / "benchmarks" / "plugins"),
        "MEGA_RING_TIMELINE": str(out), "MEGA_RING_TIMELINE_AT": "1",
    }  # fmt: skip
    args = [
        "train", "--model", "gpt", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
        "--eval-iters", "0", "--attention-dropout", "0", "--nproc-per-node", "2",
        "--context-parallel-size", "2", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    result = run_mega(args, tmp_path, env)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        summary = json.loads((out / f"ring_rank{rank}.json").read_text())["summary"]
        # CP2, one layer, two micro-batches: forward sends one block, backward one accumulator
        assert (summary["iteration"], summary["sends"], summary["arrivals"]) == (2, 4, 4)


def test_fp8_convergence_prepares_its_corpus_and_reports(tmp_path: Path):
    """The parts of benchmarks/fp8_convergence.py a CPU can run: ``prepare`` (offline corpus,
    GPT-2 BPE, ``mega preprocess``), the bf16 run's flags resolving against that corpus, and
    ``report`` on two made-up curves (the FP8 run itself needs a Hopper GPU)."""
    script = str(ROOT / "benchmarks" / "fp8_convergence.py")
    corpus = tmp_path / "corpus"
    proc = subprocess.run(
        [sys.executable, script, "prepare", "--out", str(corpus)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (corpus / "stdlib_text_document.bin").stat().st_size > 1_000_000

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fp8_convergence
    finally:
        sys.path.pop(0)
    from mega.core.config.resolve import resolve_config
    from mega.core.plugins.manager import make_plugins

    argv = fp8_convergence.train_argv(corpus, tmp_path / "run", "")
    config = resolve_config(argv[2:], make_plugins())  # after "mega train"
    assert config.data.data_path == [str(corpus / "stdlib_text_document")]

    rows = {
        name: [{"iteration": i, "lm_loss": 5.0 - i / 100 + shift} for i in range(1, 41)]
        for name, shift in (("bf16", 0.0), ("fp8", 0.01))
    }
    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps({
        "corpus": {"files": 1},
        "runs": {n: {"command": f"mega train {n}", "iterations": r} for n, r in rows.items()},
    }))  # fmt: skip
    out = tmp_path / "results"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, script, "report", "--curves", str(curves), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = out.glob("fp8_convergence_*.json")
    report = json.loads(result.read_text())
    # the mean of the last 20 iterations (21..40): bf16 5.0 - 30.5/100, fp8 0.01 above it
    assert report["final_loss"]["bf16"] == round(5.0 - 0.305, 5)
    assert abs(report["fp8_vs_bf16_final_loss_rel_diff"] - 0.01 / 4.695) < 1e-5
    assert (out / report["plot"]).stat().st_size > 10_000


def test_moe_scale_run_reshards_and_checks_on_the_cpu(tmp_path: Path):
    """The issue-25 sequence at toy size on gloo: EP=2 x DP=2 trains and saves at 3, TP=2 with SP
    (EP=1) loads it and goes on to 6, one process trains uninterrupted; fp32 losses agree to
    1e-5 (a lost expert shard or optimizer slice moves them by far more), and the row carries
    what the result file promises: save/load seconds, checkpoint bytes, router statistics."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "moe_scale_run.py"), "--first", "ep2dp2",
        "--then", "tp2-sp", "--reference", "tp1dp1", "--iters", "6", "--save-at", "3",
        "--warmup", "1", "--mbs", "1", "--gbs", "4", "--dtype", "fp32", "--bound", "1e-5",
        "--out", str(tmp_path), "--model-flags",
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2"
        " --num-experts 4 --moe-ffn-hidden-size 48 --seq-length 32 --max-position-embeddings 32"
        f" --vocab-size 255 --device cpu --master-port {free_port()}",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("moe_scale_run_*.json")
    report = json.loads(result.read_text())
    first, then, reference = report["results"]
    assert [r["world_size"] for r in report["results"]] == [2, 2, 1]
    assert [s["iteration"] for s in first["saves"]] == [3, 6]
    assert [s["iteration"] for s in then["loads"]] == [3] and not then["saves"]
    assert first["checkpoint_bytes"] > 0
    assert sorted(int(i) for i in then["lm_loss"]) == [4, 5, 6]
    assert first["dropped_token_fraction"]["mean"] == 0  # dropless: a capacity factor would
    # drop by each rank's tokens, and sequence parallelism halves those (other drops, other losses)
    assert first["load_balancing_loss"]["mean"] > 0.5  # ~1 for a balanced router
    assert report["check"]["then_vs_first"]["within_bound"]
    assert report["check"]["first_vs_reference"]["iterations"] == [1, 6]


def test_convert_round_trip_smoke_run(tmp_path: Path):
    """The 1.3B round trip's script at toy size: both conversions timed, every tensor back."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "convert_round_trip.py"), "--layers", "1",
        "--hidden", "32", "--heads", "2", "--vocab", "128", "--positions", "32",
        "--dir", str(tmp_path / "scratch"), "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("convert_round_trip_*.json")
    (row,) = json.loads(result.read_text())["results"]
    assert row["bit_identical"] and row["tensors"] > 10
    assert row["hf_to_mega"]["seconds"] > 0 and row["mega_to_hf"]["peak_rss_gib"] > 0


_FILLED_COLLECTIVES = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
import fake_rank
fake_rank.fill_like_the_collectives()
from mega.parallel import functional_comm
from mega.parallel.expert import collectives
from mega.parallel.tensor import overlapped
g = dist.group.WORLD
x = torch.arange(12.0).reshape(3, 4) + 1
both = torch.cat([x, x])
assert torch.equal(functional_comm.all_gathered(x, g), both)
assert torch.equal(functional_comm.reduce_scattered(both, g), x)
started = overlapped.start_all_gather(x, 2, functional_comm.group_name(g))
assert torch.equal(functional_comm.wait(started), both)
assert torch.equal(collectives.all_to_all_rows(x, [2, 1], [1, 2], g), x)
from mega.parallel.expert import padded_exchange
blocks = torch.arange(16.0).reshape(4, 4)
begun = padded_exchange.start_exchange(blocks, 2, functional_comm.group_name(g))
assert torch.equal(functional_comm.wait(begun), blocks)
print("filled")
"""


def test_plan_search_time_times_each_jobs_value_on_the_same_table(tmp_path: Path):
    flags = (
        "--model gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
        " --max-position-embeddings 32 --mock-data --tokenizer-type NullTokenizer --vocab-size 250"
        " --micro-batch-size 1"
        " --global-batch-size 2 --no-compile"
    )
    command = [
        sys.executable, str(ROOT / "benchmarks" / "plan_search_time.py"), "--gpus", "2",
        "--jobs", "1", "2", "--model-flags", flags, "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("plan_search_time_*.json")
    record = json.loads(result.read_text())
    assert record["same_table"] and "1. mega train" in record["table"]
    assert [row["jobs"] for row in record["results"]] == [1, 2]
    assert all(row["shapes"] == 4 and row["wall_s"] > 0 for row in record["results"])


def test_the_fake_rank_fills_the_functional_collectives_outputs():
    """The fake group writes nothing into a functional collective's new output; the fake rank's
    stand-ins must (uninitialised memory made a TP + SP rank's first gradient norm NaN on an
    H200): every rank's slice of a gather is this rank's input, a reduce-scatter keeps its slice."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-c", _FILLED_COLLECTIVES],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and "filled" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )


def test_the_tensorstore_context_plugin_saves_and_loads_through_its_context(tmp_path: Path):
    """benchmarks/plugins/tensorstore_context.py: with ``MEGA_TS_CONTEXT`` every array of the
    zarr backend opens in that one context (rank 0 says so); a save and a resume through it."""
    from mega.testing import run_mega

    env = {
        "MEGA_PLUGINS_DIR": str(ROOT / "benchmarks" / "plugins"),
        "MEGA_TS_CONTEXT": '{"file_io_concurrency": {"limit": 1}, "file_io_sync": false}',
    }
    base = [
        "train", "--model", "gpt", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--eval-iters", "0",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--lr-decay-iters", "3",
    ]  # fmt: skip
    first = run_mega([*base, "--train-iters", "2", "--run-dir", str(tmp_path / "a")], tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert 'tensorstore_context: {"file_io_concurrency"' in first.stdout
    resumed = [*base, "--train-iters", "3", "--load", str(tmp_path / "ckpt")]
    second = run_mega([*resumed, "--run-dir", str(tmp_path / "b")], tmp_path, env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "iteration        3/       3" in second.stdout


def test_every_acceptance_part_names_layouts_of_its_gpu_count():
    """benchmarks/acceptance_runs.py: every layout of every part parses and spans exactly the
    part's GPUs (a typo found on a leased machine costs its time), and the runner's dry run
    prints a part's commands and runs nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from acceptance_runs import parts
    from parallel_layouts import layout_env, layout_flags

    for gpus in (2, 4):
        for name, commands in parts(gpus, "/tmp/out", "/tmp/scratch").items():
            for command in commands:
                if "--layouts" in command:
                    layouts = command[command.index("--layouts") + 1].split(",")
                    for layout in layouts:
                        world, _ = layout_flags(layout_env(layout)[0], 4)
                        assert world == gpus, (gpus, name, layout)
                else:
                    assert command[command.index("--nproc-per-node") + 1] == str(gpus)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "acceptance_runs.py"), "--gpus", "2",
         "--part", "ep", "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "parallel_layouts.py --name acc_ep_2gpu_0" in proc.stdout


def test_the_rank_profile_plugin_stops_a_profiler_the_run_ended_inside(capsys):
    """A run shorter than MEGA_RANK_PROFILE_AT + 2 iterations left the profiler running to the
    process's exit, which aborted an EP4 rank ("double free or corruption"): the plugin's
    shutdown hook stops it and says that nothing was written."""
    import importlib.util

    path = ROOT / "benchmarks" / "plugins" / "rank_profile.py"
    spec = importlib.util.spec_from_file_location("rank_profile_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Profiler:
        stopped = 0

        def stop(self) -> None:
            self.stopped += 1

    running = Profiler()
    module._profile.profiler = running
    module.shutdown(engine=None, exc=None)
    module.shutdown(engine=None, exc=None)  # nothing left to stop: silent
    assert running.stopped == 1 and module._profile.profiler is None
    assert capsys.readouterr().err.count("nothing written") == 1


def test_the_rank_profile_plugin_writes_rank_0s_trace_or_every_ranks():
    import importlib.util

    path = ROOT / "benchmarks" / "plugins" / "rank_profile.py"
    spec = importlib.util.spec_from_file_location("rank_profile_traces", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wanted = module.trace_wanted
    assert [wanted("1", r) for r in (0, 1)] == [True, False]
    assert [wanted("all", r) for r in (0, 1)] == [True, True]
    assert [wanted(s, 0) for s in (None, "0", "")] == [False, False, False]


def test_overlap_contention_times_gemms_beside_each_collective_on_the_cpu(tmp_path: Path):
    """benchmarks/overlap_contention.py on 2 gloo ranks at toy size: a row per collective with
    the GEMMs alone, the collective alone, the GEMMs beside it, and their ratios."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "benchmarks" / "overlap_contention.py"), "--device", "cpu", "--tokens", "64",
        "--hidden", "32", "--ffn", "64", "--gemms", "2", "--collective-mib", "1", "--iters", "2",
        "--warmup", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    report = _report(command, tmp_path, "overlap_contention")
    assert report["world_size"] == 2 and report["versions"]["torch"]
    rows = report["results"]
    assert [row["collective"] for row in rows] == ["reduce_scatter_fp32", "all_to_all_bf16"]
    for row in rows:
        assert row["gemm_slowdown"] == row["gemms_beside_ms"] / row["gemms_alone_ms"]
        serial = row["gemms_alone_ms"] + row["collective_alone_ms"]
        assert row["both_vs_serial"] == row["both_ms"] / serial
        assert min(row[k] for k in ("gemms_alone_ms", "collective_alone_ms", "both_ms")) > 0


@pytest.mark.parametrize(
    "script,args",
    [
        ("swiglu_rows.py", ["--filled", "0"]),
        ("swiglu_rows.py", []),
        ("grad_accumulation.py", ["--sizes", "0,x"]),
        ("grad_accumulation.py", []),
        ("sm_contention.py", ["--carveouts", "0"]),
        ("sm_contention.py", []),
    ],
    ids=[
        "swiglu-bad-share",
        "swiglu-no-gpu",
        "accumulation-bad-sizes",
        "accumulation-no-gpu",
        "contention-bad-carveout",
        "contention-no-gpu",
    ],  # fmt: skip
)
def test_kernel_benchmarks_refuse_in_one_line(tmp_path: Path, script: str, args: list[str]):
    """The kernel benchmarks time CUDA kernels: without a CUDA GPU (or with a bad argument) one
    error line, exit 2, no result file."""
    import torch

    if not args and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the benchmark runs")
    command = [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(tmp_path)]
    proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()][-1].startswith("error: ")
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_the_memory_peak_plugin_replays_what_lives_at_the_peak():
    """benchmarks/plugins/memory_peak.py: the blocks alive at the highest point of an allocator
    trace, by the innermost mega frame (a block freed before the peak is not among them)."""
    import importlib.util

    path = ROOT / "benchmarks" / "plugins" / "memory_peak.py"
    spec = importlib.util.spec_from_file_location("memory_peak_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def frames(line: int) -> list[dict]:
        return [
            {"filename": "/tmp/torchinductor/kernel.py", "line": 9, "name": "call"},
            {"filename": "/x/mega/layer.py", "line": line, "name": "forward"},
        ]

    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames(1)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames(2)},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 30, "frames": frames(2)},
        {"action": "alloc", "addr": 4, "size": 80, "frames": frames(2)},  # the peak: 160
        {"action": "free_requested", "addr": 4, "size": 80},
    ]
    peak, by_place = module.live_at_peak(events)
    assert peak == 160
    assert by_place == {("layer.py:2 forward", "kernel.py:9 call"): [50, 30, 80]}
    assert module._blocks([2_000_000, 500_000, 2_000_000]) == "2 x 2.0 MB, 1 x 0.5 MB"


def test_the_rank_profile_plugin_refuses_an_unknown_cpu_setting(monkeypatch, tmp_path):
    """MEGA_RANK_PROFILE_CPU is 0 (the GPU's kernels alone) or 1 (and the host's side): another
    value is refused by name, not read as one of them."""
    import importlib.util

    path = ROOT / "benchmarks" / "plugins" / "rank_profile.py"
    spec = importlib.util.spec_from_file_location("rank_profile_cpu_setting", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("MEGA_RANK_PROFILE", str(tmp_path))
    monkeypatch.setenv("MEGA_RANK_PROFILE_CPU", "no")
    with pytest.raises(ValueError, match="MEGA_RANK_PROFILE_CPU='no'"):
        module.step_end(engine=None, iteration=1, metrics={})
    monkeypatch.setenv("MEGA_RANK_PROFILE_CPU", "0")
    module.step_end(engine=None, iteration=1, metrics={})  # accepted (and, off GPUs, a no-op)


def _sync_watch_module():
    import importlib.util

    path = ROOT / "benchmarks" / "plugins" / "sync_watch.py"
    spec = importlib.util.spec_from_file_location("sync_watch_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_stand_ins(monkeypatch) -> tuple[list, list]:
    """The debug mode's settings and the synchronize calls, recorded (CPU builds have neither)."""
    import torch

    modes, synced = [], []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    for owner in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(owner, "synchronize", lambda obj, _o=owner: synced.append(_o))
    return modes, synced


def test_the_sync_watch_plugin_names_the_code_that_synced(monkeypatch, tmp_path):
    """benchmarks/plugins/sync_watch.py turns PyTorch's sync-debug warnings and events'
    synchronize into call sites outside torch, counted per step; other warnings (the debug
    mode's own notice among them) still show, and everything is put back."""
    import warnings

    import torch

    module = _sync_watch_module()
    modes, synced = _cpu_stand_ins(monkeypatch)
    originals = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    watch = module._SyncWatch()

    def reads_the_loss() -> None:
        warnings.warn(module.SYNC_WARNING, UserWarning, stacklevel=1)

    def waits_for_an_event() -> None:
        torch.cuda.Event.synchronize(object())

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest, **kw: shown.append(message))
    watch.start()
    for _ in range(module.STEPS):
        reads_the_loss()
        waits_for_an_event()
    notice = "Synchronization debug mode is a prototype feature: not all synchronizing ops"
    warnings.warn(notice, UserWarning, stacklevel=1)
    watch.stop(3, tmp_path)
    assert [str(m) for m in shown] == [notice]
    assert modes == ["warn", "default"] and synced == [torch.cuda.Event] * module.STEPS
    text = (tmp_path / "syncs_rank3.txt").read_text()
    assert text.startswith("rank 3: 2 host-GPU syncs a step")
    assert text.count("1 a step:") == 2 and "Event.synchronize" in text
    assert "reads_the_loss" in text and "waits_for_an_event" in text
    assert "warnings.py" not in text and "sync_watch.py" not in text
    assert (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize) == originals


def test_the_sync_watch_plugin_puts_everything_back_when_the_run_ends_inside(monkeypatch, capsys):
    """A run that stops inside the watched steps leaves no debug mode or wrapper behind."""
    import torch

    module = _sync_watch_module()
    modes, _ = _cpu_stand_ins(monkeypatch)
    originals = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    watch = module._SyncWatch()
    watch.start()
    watch.shutdown()
    watch.shutdown()  # once only
    assert modes == ["warn", "default"]
    assert (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize) == originals
    assert capsys.readouterr().err.count("nothing written") == 1
