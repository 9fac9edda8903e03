"""benchmarks/checkpoint_io.py on two gloo ranks at toy size: the tensor-parallel layout whose
"create arrays" step failed on 2 GPUs (every rank created the same arrays: ALREADY_EXISTS), and
whose DCP state named both ranks' shards alike, so DCP wrote one and loaded it on both."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from mega.testing.ranks import free_port

from conftest import LAUNCHER_VARS

ROOT = Path(__file__).resolve().parents[1]

TOY = (
    "--model gpt --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --max-position-embeddings 32 --vocab-size 255 --micro-batch-size 1 --global-batch-size 4"
    " --mock-data --tokenizer-type NullTokenizer --lr 1e-4 --eval-iters 0 --train-iters 1"
    " --bf16 --device cpu"
)


def test_checkpoint_io_on_two_tensor_parallel_ranks(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", MEGA_BENCH_COMMIT="abc123")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(ROOT / "benchmarks" / "checkpoint_io.py"),
        "--dir", str(tmp_path / "scratch"), "--out", str(tmp_path / "out"), "--name", "smoke",
        "--dd-mb", "8", "--model", TOY,
        "--flags", "--tensor-model-parallel-size 2 --use-distributed-optimizer",
    ]  # fmt: skip
    before = datetime.date.today().isoformat()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    dates = {before, datetime.date.today().isoformat()}
    (result,) = (tmp_path / "out").glob("checkpoint_io_*.json")
    assert result.name in {f"checkpoint_io_smoke_{date}.json" for date in dates}
    record = json.loads(result.read_text())
    assert record["commit"] == "abc123"
    assert (
        "checkpoint_io.py" in record["command"]
        and "--tensor-model-parallel-size 2" in (record["command"])
    )
    assert {"python", "mega", "torch", "tensorstore"} <= record["versions"].keys()
    assert record["world_size"] == record["ranks"] == 2
    assert record["layout"] == "world 2 = dp 1 x pp 1 x cp 1 x tp 2"
    assert record["layout_sizes"]["tensor_model_parallel_size"] == 2
    r = record["results"]
    # load equals save, every piece on every rank, for both
    assert r["mega_round_trip_equal"] and r["mega_round_trip_mismatches"] == []
    assert r["dcp_round_trip_equal"] and r["dcp_round_trip_mismatches"] == []
    for key in (
        "mega_save_s", "mega_load_s", "dcp_save_s", "dcp_load_s", "mega_save_gb_s",
        "mega_load_gb_s", "dcp_save_gb_s", "dcp_load_gb_s", "dd_write_gb_s",
        "mega_async_stall_s", "mega_async_total_s_second", "mega_create_arrays_s",
        "checkpoint_gb", "dcp_checkpoint_gb", "mega_save_s_second", "dcp_save_s_second",
        "save_vs_dcp_second",
    ):  # fmt: skip
        assert r[key] > 0, key
    assert "conv=fsync" in r["dd_command"] and "bs=1M" in r["dd_command"]
    assert r["arrays"] > 10
    assert not (tmp_path / "scratch").exists()  # the checkpoints are erased
