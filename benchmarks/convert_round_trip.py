"""The 1.3B GPT through `mega convert-checkpoint` and back: Hugging Face -> mega -> Hugging Face,
timed, with the peak resident memory of each conversion and a bit-for-bit check of every tensor.

    python benchmarks/convert_round_trip.py                       # the 1.3B GPT-2 shape
    python benchmarks/convert_round_trip.py --layers 2 --hidden 64 --heads 4 --vocab 512  # smoke

The source is a ``GPT2LMHeadModel`` of Megatron's 1.3B shape (24 layers, hidden 2048, 16 heads,
vocabulary 50257, 2048 positions), randomly initialised by transformers in float32 and written
with ``save_pretrained`` (5 GB shards). Each conversion is the real command in its own process
(``python -m mega convert-checkpoint``), so its wall time includes starting Python and torch; its
peak resident memory is the child's own ``ru_maxrss``, which counts the pages of the files
it memory-maps (safetensors are) as well as its own allocations. The check opens the source and the round trip
with safetensors and compares every tensor's bytes. Writes
``benchmarks/results/convert_round_trip_<date>.json`` (``--out``) with the commit, command, disk,
versions and numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel_layouts import write_json

# the child reports its own peak resident memory (ru_maxrss, KiB) on its last stderr line
CHILD = (
    "import resource, runpy, sys\n"
    "sys.argv = ['mega', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('mega', run_name='__main__')\n"
    "finally:\n"
    "    print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
)


def convert(src: Path, dst: Path, *flags: str) -> dict:
    """One ``mega convert-checkpoint`` in a child process: its wall seconds and peak RSS."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "convert-checkpoint", str(src), str(dst), *flags],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"convert-checkpoint failed:\n{done.stderr[-2000:]}")
    peak_kib = int(done.stderr.strip().splitlines()[-1].split()[-1])
    return {
        "seconds": round(seconds, 2),
        "peak_rss_gib": round(peak_kib / 2**20, 3),
        "output_tail": done.stdout.strip().splitlines()[-3:],
    }


def tensors_equal(a: Path, b: Path) -> tuple[int, list[str]]:
    """How many tensors the two safetensors directories hold, and those that differ."""
    from safetensors import safe_open

    def names(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as handle:
                out.update({k: f for k in handle.keys()})
        return out

    left, right = names(a), names(b)
    differ = sorted(set(left) ^ set(right))
    for key in sorted(set(left) & set(right)):
        with safe_open(str(left[key]), "pt") as x, safe_open(str(right[key]), "pt") as y:
            t, u = x.get_tensor(key), y.get_tensor(key)
            if t.dtype != u.dtype or t.shape != u.shape or not bool((t == u).all()):
                differ.append(key)
    return len(left), differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--name", default="convert_round_trip")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="mega-roundtrip-"))
    scratch.mkdir(parents=True, exist_ok=True)
    hf, mega, back = scratch / "hf", scratch / "m", scratch / "back"
    for d in (hf, mega, back):
        shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
        n_positions=args.positions, architectures=["GPT2LMHeadModel"],
    )  # fmt: skip
    started = time.perf_counter()
    model = GPT2LMHeadModel(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf, max_shard_size="5GB")
    del model
    made = time.perf_counter() - started
    source_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    to_mega = convert(hf, mega)
    to_hf = convert(mega, back, "--to", "hf")
    count, differ = tensors_equal(hf, back)
    row = {
        "parameters": parameters,
        "safetensors_gb": round(source_bytes / 1e9, 3),
        "make_source_s": round(made, 1),
        "hf_to_mega": to_mega,
        "mega_to_hf": to_hf,
        "hf_to_mega_gb_per_s": round(source_bytes / 1e9 / to_mega["seconds"], 3),
        "mega_to_hf_gb_per_s": round(source_bytes / 1e9 / to_hf["seconds"], 3),
        "tensors": count,
        "tensors_differing": differ,
        "bit_identical": not differ,
        "cpus": os.cpu_count(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = write_json(Path(args.out), args.name, {"results": [row]})
    print(json.dumps({k: v for k, v in row.items() if k != "tensors_differing"}))
    print(path)
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
