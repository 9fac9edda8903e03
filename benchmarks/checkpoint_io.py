"""Checkpoint save/load speed of a ~1.3B GPT with its optimizer state: mega's zarr backend against
torch.distributed.checkpoint (DCP) writing the same tensors to the same disk, and the disk's own
sequential write speed (dd with fsync), all in one run.

    python benchmarks/checkpoint_io.py --dir /scratch/ckpt-bench                 # one GPU
    torchrun --nproc-per-node 2 benchmarks/checkpoint_io.py --dir D --flags "--tensor-model-parallel-size 2"

Every rank builds the model through ``mega train``'s own code (``Engine.setup``), takes one
training step so that the optimizer state is real, then, in this order:

* ``mega save``: the engine's sharded save (``save_run``: the same call ``--save`` makes), then
  ``mega load`` of it (``load_run``, the call ``--load`` makes);
* ``mega async stall``: how long the step that starts an ``--async-save`` waits, for the first
  save and a second one, and the time until each is complete; the one-off pinning of the host
  buffer (``Engine.setup`` does it before the first step); how much of the stall creating the
  empty arrays is;
* ``dcp save``: ``torch.distributed.checkpoint.save`` of the same tensors (the model's
  parameters and the optimizer's flat fp32 state, this rank's), with DCP's file writer;
* ``dcp load`` of what it wrote. Loads read a page cache warm from the save, for both: the
  machine cannot drop it without changing its settings. One checkpoint is on disk at a time;
* ``dd``: ``dd if=/dev/zero bs=16M count=... conv=fsync`` into the same directory.

GB/s is the checkpoint's bytes on disk over the wall time, all ranks together (rank 0 reports).
Rank 0's resident host memory is recorded before the saves and at its peak during them
(sampled every 20 ms; the pinned ``--async-save`` buffer counts).
Writes ``benchmarks/results/checkpoint_io_<date>[_<label>].json`` with the command, device,
versions and numbers.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODEL = [
    "--model", "gpt", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "50175", "--bf16", "--lr", "1e-4", "--eval-iters", "0", "--train-iters", "1",
]  # fmt: skip


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _rss_gb() -> float:
    """This process's resident host memory now, in GB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


class _PeakRss:
    """The largest resident host memory seen while it runs (sampled every 20 ms)."""

    def __init__(self) -> None:
        self.peak = _rss_gb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_gb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_gb())


def _dd(directory: Path, gigabytes: int) -> float:
    target = directory / "dd.bin"
    count = gigabytes * 64  # 16 MiB blocks
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync"],
        check=True, capture_output=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    size = target.stat().st_size
    target.unlink()
    return size / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where checkpoints are written (erased)")
    parser.add_argument("--flags", default="", help="extra mega train flags (layout)")
    parser.add_argument("--label", default="", help="suffix of the result file name")
    parser.add_argument("--model", default=" ".join(MODEL), help="the model's mega train flags")
    parser.add_argument("--dd-gb", type=int, default=8, help="GB that dd writes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from mega.core.checkpoint.state import (
        finish_pending_save,
        load_run,
        prepare_async_save,
        save_run,
        sharded_tensors,
    )
    from mega.core.config.resolve import resolve_config
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine

    root = Path(args.dir)
    argv = shlex.split(args.model) + shlex.split(args.flags)
    plugins = make_plugins()
    mega_dir = root / "mega"
    config = resolve_config(
        [*argv, "--save", str(mega_dir), "--run-dir", str(root / "run")], plugins
    )
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()  # one step: real optimizer state
    rank0 = engine.topology.rank == 0
    if rank0:
        shutil.rmtree(mega_dir, ignore_errors=True)
        shutil.rmtree(root / "dcp", ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    _sync()
    rss_before = _rss_gb()
    peak_rss = _PeakRss()
    state_bytes = (
        sum(p.numel() * p.element_size() for p in engine.model.parameters())
        + engine.optimizer.state_bytes()
    )
    results: dict = {}

    # one checkpoint on disk at a time: the disk holds about 3 of the 1.3B's
    def clear(path: Path) -> None:
        _sync()
        if rank0:
            shutil.rmtree(path, ignore_errors=True)
        _sync()

    results["mega_save_s"] = _timed(lambda: save_run(engine))
    written = _bytes(mega_dir / "iter_0000001") if rank0 else 0
    results["mega_load_s"] = _timed(lambda: load_run(engine, str(mega_dir)))
    clear(mega_dir)

    engine.config.checkpoint.async_save = True
    # what Engine.setup does under --async-save: pin the host buffer before the first step
    results["mega_async_pin_s"] = _timed(lambda: prepare_async_save(engine))
    for attempt in ("first", "second"):  # the second reuses the buffer, as every later save
        _sync()
        start = time.perf_counter()
        save_run(engine)  # what the training step waits for
        results[f"mega_async_stall_s_{attempt}"] = time.perf_counter() - start
        results[f"mega_async_total_s_{attempt}"] = results[
            f"mega_async_stall_s_{attempt}"
        ] + _timed(lambda: finish_pending_save(engine))
        clear(mega_dir)
    results["mega_async_pinned"] = engine.host_copy.pinned
    results["mega_async_stall_s"] = max(
        results["mega_async_stall_s_first"], results["mega_async_stall_s_second"]
    )
    # the part of the stall that creating the empty arrays takes (metadata files)
    backend = engine.plugins.checkpoint_backends.get("zarr")
    arrays = [t for t in sharded_tensors(engine) if t.write and t.pieces]
    results["mega_create_arrays_s"] = _timed(lambda: backend.create(root / "create", arrays))
    results["arrays_written_rank0"] = len(arrays)
    print(json.dumps(results), flush=True)  # so far, should a later part fail
    clear(root / "create")
    engine.config.checkpoint.async_save = False
    rss_peak_saves = peak_rss.stop()

    from torch.distributed import checkpoint as dcp

    dcp_state = {f"model.{n}": p.detach() for n, p in engine.model.named_parameters()}
    rank = engine.topology.rank
    for name, flat in engine.optimizer.flat_states().items():  # this rank's shard, unique keys
        dcp_state[f"optimizer.{name}.rank{rank}"] = flat
    dcp_dir = root / "dcp"
    results["dcp_save_s"] = _timed(lambda: dcp.save(dcp_state, checkpoint_id=str(dcp_dir)))
    dcp_bytes = _bytes(dcp_dir) if rank0 else 0
    results["dcp_load_s"] = _timed(lambda: dcp.load(dcp_state, checkpoint_id=str(dcp_dir)))
    clear(dcp_dir)
    if rank0:
        results["dd_write_gb_s"] = _dd(root, args.dd_gb)
        gb = written / 1e9
        results.update(
            {
                "checkpoint_gb": gb,
                "dcp_checkpoint_gb": dcp_bytes / 1e9,
                "state_gb_rank0": state_bytes / 1e9,
                "mega_save_gb_s": gb / results["mega_save_s"],
                "mega_load_gb_s": gb / results["mega_load_s"],
                "dcp_save_gb_s": dcp_bytes / 1e9 / results["dcp_save_s"],
                "dcp_load_gb_s": dcp_bytes / 1e9 / results["dcp_load_s"],
                "rss_gb_before_saves": rss_before,
                "rss_gb_peak_during_saves": rss_peak_saves,
                "rss_gb_growth_during_saves": rss_peak_saves - rss_before,
            }
        )
        results["save_vs_dcp"] = results["mega_save_gb_s"] / results["dcp_save_gb_s"]
        results["load_vs_dcp"] = results["mega_load_gb_s"] / results["dcp_load_gb_s"]
        results["save_vs_disk"] = results["mega_save_gb_s"] / results["dd_write_gb_s"]
        record = {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "world_size": engine.topology.world_size,
            "layout": engine.topology.describe(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "tensorstore": importlib.metadata.version("tensorstore"),
            },
            "results": results,
        }
        text = json.dumps(record, indent=1)
        print(text)
        label = f"_{args.label}" if args.label else ""
        out = Path(
            args.out
            or Path(__file__).parent / "results" / f"checkpoint_io_{record['date']}{label}.json"
        )
        out.write_text(text + "\n")
    shutil.rmtree(root, ignore_errors=True) if rank0 else None
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "8")
    main()
