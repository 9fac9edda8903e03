"""Checkpoint save/load speed of a ~1.3B GPT with its optimizer state: mega's zarr backend against
torch.distributed.checkpoint (DCP) writing the same tensors to the same disk, and the disk's own
sequential write speed (dd with fsync), all in one run, on one rank or several.

    python benchmarks/checkpoint_io.py --dir /scratch/ckpt-bench                 # one GPU
    torchrun --nproc-per-node 2 benchmarks/checkpoint_io.py --dir D --name 2gpu_tp2 \
        --flags "--tensor-model-parallel-size 2"

Every rank builds the model through ``mega train``'s own code (``Engine.setup``), takes one
training step so that the optimizer state is real, copies what it saves (``--no-verify``: not),
then, in this order:

* ``mega save``: the engine's sharded save (``save_run``: the same call ``--save`` makes), then
  ``mega load`` of it (``load_run``, the call ``--load`` makes) into state zeroed first; every
  rank's loaded values are compared with the copy (``mega_round_trip_equal``); then a second
  ``mega save`` (``mega_save_s_second``: a run's later saves; the first of a process pays
  one-off costs);
* ``mega async stall``: how long the step that starts an ``--async-save`` waits (``save_run``
  returning), for the first save and a second one; when its device-to-host copies are done (the
  next optimizer update waits for them on the GPU, not the CPU); the time until each save is
  complete; the one-off pinning of the host buffer (``Engine.setup`` does it before the first
  step); how much of the stall creating the empty arrays is (``create_arrays``: the call the save
  makes, each array created once, by the lowest rank writing it);
* ``dcp save``: ``torch.distributed.checkpoint.save`` of the same tensors, with DCP's file
  writer (``--dcp-threads``, default 1 as DCP's): every piece mega writes, named by its key and
  offset, so that replicas (data-parallel, tensor-parallel norms) share a name and DCP writes
  them once, as mega does, and shards have their own;
* ``dcp load`` of what it wrote, into state zeroed first, compared as mega's, then a second
  ``dcp save`` (``dcp_save_s_second``; ``save_vs_dcp_second`` compares the two second saves).
  Loads read a page cache warm from the save, for both: the machine cannot drop it without
  changing its settings. One checkpoint is on disk at a time;
* ``dd``: ``dd if=/dev/zero of=F bs=1M count=N conv=fsync`` (``--dd-mb`` N) in the same
  directory, rank 0 alone.

GB/s is the checkpoint's bytes on disk over the wall time, all ranks together (rank 0 reports;
``--dir`` must be one file system that every rank sees, as on one host).
``written_gb_by_rank``: the bytes of state each rank writes (the save waits for the slowest).
Rank 0's resident host memory is recorded before the saves and at its peak during them
(sampled every 20 ms; the pinned ``--async-save`` buffer counts).
Writes ``<--out>/checkpoint_io_<name>_<date>.json`` (default ``benchmarks/results``) with the
commit (``MEGA_BENCH_COMMIT`` or git), command, device, versions, rank count, layout and numbers.
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

ROOT = Path(__file__).resolve().parent.parent
from parallel_layouts import commit  # noqa: E402  (a sibling: this script's directory)

MODEL = [
    "--model", "gpt", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "50175", "--bf16", "--use-distributed-optimizer", "--lr", "1e-4",
    "--eval-iters", "0", "--train-iters", "1",
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


def _dd(directory: Path, megabytes: int) -> dict:
    """``dd if=/dev/zero of=F bs=1M count=N conv=fsync`` in ``directory``: the disk's sequential
    write rate with the data on the disk, as the checkpoints' saves end."""
    target = directory / "dd.bin"
    command = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fsync"]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    size = target.stat().st_size
    target.unlink()
    return {
        "dd_command": " ".join(command),
        "dd_gb": size / 1e9,
        "dd_s": seconds,
        "dd_write_gb_s": size / seconds / 1e9,
    }


def _all_ranks(values: list) -> list:
    """Every rank's ``values``, concatenated in rank order (a collective)."""
    if not dist.is_initialized():
        return list(values)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [v for theirs in gathered for v in theirs]


class _RoundTrip:
    """Whether a load gives back what was saved: a copy of every piece that the ranks save or
    load (``ShardedTensor`` pieces: views of the model's parameters and the optimizer's flat
    states), taken before the saves; :meth:`scramble` zeroes the pieces before a load, and
    :meth:`mismatches` names, over all ranks, the pieces that differ after it."""

    def __init__(self, tensors: list) -> None:
        self.pieces = [(f"{t.key}@{list(p.start)}", p.data) for t in tensors for p in t.pieces]
        self.saved = [data.detach().clone() for _, data in self.pieces]

    def scramble(self) -> None:
        with torch.no_grad():
            for _, data in self.pieces:
                data.zero_()

    def mismatches(self) -> list[str]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = [
            f"rank {rank}: {name}"
            for (name, data), saved in zip(self.pieces, self.saved, strict=True)
            if not torch.equal(data, saved)
        ]
        return _all_ranks(mine)


def _dcp_state(tensors: list) -> dict:
    """The state mega saves, as a DCP state dict: one entry per piece (its key and where it starts
    in the global tensor). Pieces that several ranks hold (data-parallel replicas, tensor-parallel
    replicated norms) have the same entry name on each, and DCP's planner writes each once, as
    mega does; tensor-parallel shards and distributed-optimizer ranges have their own names.
    (Plain per-rank tensors under one name would be taken for replicas: DCP would write one
    rank's shard only and load it into every rank.)"""
    return {f"{t.key}@{','.join(map(str, p.start))}": p.data for t in tensors for p in t.pieces}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where checkpoints are written (erased)")
    parser.add_argument("--flags", default="", help="extra mega train flags (layout)")
    parser.add_argument(
        "--name", "--label", default=None,
        help="result file: checkpoint_io_<name>_<date>.json (default: the layout, e.g. 2gpu_tp2)",
    )  # fmt: skip
    parser.add_argument("--model", default=" ".join(MODEL), help="the model's mega train flags")
    parser.add_argument("--dd-mb", type=int, default=8192, help="MiB that dd writes (bs=1M)")
    parser.add_argument(
        "--dcp-threads", type=int, default=1, help="DCP FileSystemWriter thread_count (its default)"
    )
    parser.add_argument(
        "--verify", action=argparse.BooleanOptionalAction, default=True,
        help="check that each load gives back the saved values (a copy of the state on device)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory")
    args = parser.parse_args()

    from torch.distributed import checkpoint as dcp

    from mega import __version__ as mega_version
    from mega.core.checkpoint.sharded_store import create_arrays
    from mega.core.config.resolve import resolve_config
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine
    from mega.core.training.run_state import (
        finish_pending_save,
        layout_of,
        load_run,
        prepare_async_save,
        save_run,
        sharded_tensors,
    )

    root = Path(args.dir).resolve()
    argv = shlex.split(args.model) + shlex.split(args.flags)
    plugins = make_plugins()
    mega_dir = root / "mega"
    config = resolve_config([*argv, "--run-dir", str(root / "run")], plugins)
    engine = Engine(config, plugins, Display(enabled=False))
    engine.train()  # one step: real optimizer state (no --save: no save at its end)
    engine.config.checkpoint.save = str(mega_dir)
    topo = engine.topology
    rank0 = topo.rank == 0
    if rank0:
        shutil.rmtree(mega_dir, ignore_errors=True)
        shutil.rmtree(root / "dcp", ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    _sync()
    tensors = sharded_tensors(engine)  # views: what mega saves and loads on this rank
    check = _RoundTrip(tensors) if args.verify else None
    rss_before = _rss_gb()
    peak_rss = _PeakRss()
    state_bytes = (
        sum(p.numel() * p.element_size() for p in engine.model.parameters())
        + engine.optimizer.state_bytes()
    )
    # the bytes each rank's pieces hold to write (a chunk that the pieces of several ranks share
    # is gathered at one of them first: a part of a chunk moves): the slowest rank sets the pace
    written_by_rank = _all_ranks(
        [sum(p.data.numel() * p.data.element_size() for t in tensors if t.write for p in t.pieces)]
    )
    results: dict = {}

    # one checkpoint on disk at a time: the disk holds about 3 of the 1.3B's
    def clear(path: Path) -> None:
        _sync()
        if rank0:
            shutil.rmtree(path, ignore_errors=True)
        _sync()

    results["mega_save_s"] = _timed(lambda: save_run(engine))
    written = _bytes(mega_dir / f"iter_{engine.iteration:07d}") if rank0 else 0
    if check:
        check.scramble()
    results["mega_load_s"] = _timed(lambda: load_run(engine, str(mega_dir)))
    if check:
        wrong = check.mismatches()
        results["mega_round_trip_equal"] = not wrong
        results["mega_round_trip_mismatches"] = wrong[:8]
    clear(mega_dir)
    # a second save, as every save of a run after its first: the first of a process (mega's and
    # DCP's alike) pays one-off costs, and DCP's first ran after mega's saves had warmed the
    # machine; both are recorded, and the ratios of both
    results["mega_save_s_second"] = _timed(lambda: save_run(engine))
    clear(mega_dir)

    engine.config.checkpoint.async_save = True
    # what Engine.setup does under --async-save: pin the host buffer before the first step
    results["mega_async_pin_s"] = _timed(lambda: prepare_async_save(engine))
    for attempt in ("first", "second"):  # the second reuses the buffer, as every later save
        _sync()
        start = time.perf_counter()
        save_run(engine)  # what the training step waits for
        stall = time.perf_counter() - start
        engine.host_copy.wait()  # the device-to-host copies: the next optimizer update waits
        copies = time.perf_counter() - start  # for them on the GPU (not the CPU) if still running
        results[f"mega_async_stall_s_{attempt}"] = stall
        results[f"mega_async_copies_done_s_{attempt}"] = copies
        results[f"mega_async_total_s_{attempt}"] = stall + _timed(
            lambda: finish_pending_save(engine)
        )
        clear(mega_dir)
    results["mega_async_pinned"] = engine.host_copy.pinned
    results["mega_async_stall_s"] = max(
        results["mega_async_stall_s_first"], results["mega_async_stall_s_second"]
    )
    # the part of the stall that creating the empty arrays takes (the ranks agree on who
    # creates which array, then each creates its own: metadata files)
    backend = engine.plugins.checkpoint_backends.get("zarr")
    arrays: dict = {}

    def create() -> None:
        arrays.update(create_arrays(root / "create", tensors, backend))

    results["mega_create_arrays_s"] = _timed(create)
    results["arrays"] = len(arrays)
    print(json.dumps(results), flush=True)  # so far, should a later part fail
    clear(root / "create")
    engine.config.checkpoint.async_save = False
    rss_peak_saves = peak_rss.stop()

    dcp_state = _dcp_state(tensors)
    dcp_dir = root / "dcp"
    writer = dcp.FileSystemWriter(str(dcp_dir), thread_count=args.dcp_threads)
    results["dcp_save_s"] = _timed(lambda: dcp.save(dcp_state, storage_writer=writer))
    dcp_bytes = _bytes(dcp_dir) if rank0 else 0
    if check:
        check.scramble()
    reader = dcp.FileSystemReader(str(dcp_dir))
    results["dcp_load_s"] = _timed(lambda: dcp.load(dcp_state, storage_reader=reader))
    if check:
        wrong = check.mismatches()
        results["dcp_round_trip_equal"] = not wrong
        results["dcp_round_trip_mismatches"] = wrong[:8]
    clear(dcp_dir)
    writer = dcp.FileSystemWriter(str(dcp_dir), thread_count=args.dcp_threads)
    results["dcp_save_s_second"] = _timed(lambda: dcp.save(dcp_state, storage_writer=writer))
    clear(dcp_dir)
    if rank0:
        results.update(_dd(root, args.dd_mb))
        gb = written / 1e9
        results.update(
            {
                "checkpoint_gb": gb,
                "dcp_checkpoint_gb": dcp_bytes / 1e9,
                "state_gb_rank0": state_bytes / 1e9,
                "written_gb_by_rank": [n / 1e9 for n in written_by_rank],
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
        results["save_vs_dcp_second"] = results["dcp_save_s_second"] / results["mega_save_s_second"]
        results["load_vs_dcp"] = results["mega_load_gb_s"] / results["dcp_load_gb_s"]
        results["save_vs_disk"] = results["mega_save_gb_s"] / results["dd_write_gb_s"]
        cuda = torch.cuda.is_available() and engine.device.type == "cuda"
        layout = layout_of(engine)
        name = args.name or (
            f"{topo.world_size}{'gpu' if cuda else 'cpu'}"
            f"_tp{layout['tensor_model_parallel_size']}"
            f"pp{layout['pipeline_model_parallel_size']}dp{layout['data_parallel_size']}"
        )
        record = {
            "name": name,
            "date": datetime.date.today().isoformat(),
            "commit": commit(),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "world_size": topo.world_size,
            "ranks": topo.world_size,
            "layout": topo.describe(),
            "layout_sizes": layout,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "checkpoint_dir": str(root),
            "versions": {
                "python": platform.python_version(),
                "mega": mega_version,
                "torch": torch.__version__,
                "tensorstore": importlib.metadata.version("tensorstore"),
            },
            "results": results,
        }
        text = json.dumps(record, indent=1)
        print(text)
        out = Path(args.out) / f"checkpoint_io_{name}_{record['date']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"wrote {out}", flush=True)
    _sync()
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    wrong = [
        k for k in ("mega_round_trip_equal", "dcp_round_trip_equal") if results.get(k) is False
    ]
    if wrong:  # every rank knows (the mismatches are gathered): the numbers are of a bad save
        sys.exit(f"checkpoint_io: a load did not give back the saved state ({', '.join(wrong)})")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "8")
    main()
