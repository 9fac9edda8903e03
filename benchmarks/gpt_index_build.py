"""GPT dataset index build and cache reload for a 1-billion-token corpus at --seq-length 2048.

    python benchmarks/gpt_index_build.py                  # writes benchmarks/results/
    python benchmarks/gpt_index_build.py --megatron       # also time megatron-core and compare

Targets: build < 10 s, reload from cache < 1 s. The corpus is synthetic: an ``.idx`` with
lognormal document lengths (mean ~1000 tokens, so ~1M documents summing to 1e9 tokens) and a
*sparse* ``.bin`` of the right size (2 GB of uint16 that occupy no disk), because building the
indices reads only the lengths, never the tokens.

Measured for train/valid/test with ``--split 969,30,1`` and two train sample counts: one epoch,
and three epochs (a partial, separate last epoch). "build" is a cold ``build_gpt_splits`` (open
the ``.idx``, build all three splits' indices, save the cache); "reload" is the same call again,
which finds the cache and memory-maps it. Each reload also runs in a fresh process, which is what
a rank does at start-up. ``--megatron`` builds the same splits with megatron-core's
``BlendedMegatronDatasetBuilder`` (its C++ helper) and checks that every index array is equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TOKENS = 1_000_000_000
SEQ_LENGTH = 2048
SPLIT = "969,30,1"
SEED = 1234
TARGET_BUILD_S = 10.0
TARGET_RELOAD_S = 1.0


def write_corpus(prefix: Path, tokens: int, seed: int = 0) -> int:
    """An .idx of lognormal lengths summing to ``tokens`` and a sparse uint16 .bin; returns docs."""
    from mega.plugins.datasets.indexed import CODES, HEADER, MAGIC, VERSION

    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(1000.0) - sigma**2 / 2  # mean exp(mu + sigma^2/2) = 1000
    lengths = np.maximum(1, rng.lognormal(mu, sigma, int(tokens / 1000 * 1.1))).astype(np.int64)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, tokens)) + 1
    lengths = lengths[:count]
    lengths[-1] -= int(lengths.sum()) - tokens  # exactly `tokens` in all
    dtype = np.dtype(np.uint16)
    pointers = np.zeros(count, dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    documents = np.arange(count + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODES[dtype], count, count + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(documents.astype("<i8").tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * dtype.itemsize)  # sparse: no blocks written
    return count


def requested(train_samples: int) -> tuple[int, int, int]:
    """Megatron's valid/test counts for eval_interval 1000, eval_iters 10, batch 512."""
    gbs, eval_iters = 512, 10
    train_iters = train_samples // gbs
    return train_samples, (train_iters // 1000 + 1) * eval_iters * gbs, eval_iters * gbs


def mega_build(prefix: str, cache: str, sizes: tuple[int, int, int]):
    from mega.plugins.datasets.gpt.builder import build_gpt_splits
    from mega.plugins.datasets.gpt.samples import SampleOptions

    options = SampleOptions(seq_length=SEQ_LENGTH, eod=0)
    return build_gpt_splits([prefix], SPLIT, sizes, SEED, options, cache_path=cache)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


RELOAD_SNIPPET = """
import time
start = time.perf_counter()
from mega.plugins.datasets.gpt.builder import build_gpt_splits
from mega.plugins.datasets.gpt.samples import SampleOptions
built = build_gpt_splits([{prefix!r}], {split!r}, {sizes!r}, {seed}, SampleOptions(seq_length={seq}, eod=0),
                         cache_path={cache!r})
assert {{p.cache for p in built.parts}} == {{"loaded"}}, [p.cache for p in built.parts]
built.splits[0][0]  # one sample read through the loaded indices
print(time.perf_counter() - start)
"""


def reload_in_fresh_process(prefix: str, cache: str, sizes: tuple[int, int, int]) -> float:
    """Seconds from a new interpreter's first line to loaded indices (numpy import included)."""
    code = RELOAD_SNIPPET.format(
        prefix=prefix, split=SPLIT, sizes=sizes, seed=SEED, seq=SEQ_LENGTH, cache=cache
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def megatron_build(prefix: str, cache: str, sizes: tuple[int, int, int]):
    import torch.distributed
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tokenizer:  # what GPTDatasetConfig reads from a tokenizer
        vocab_size, eod, pad, eos = 50257, 0, 1, 0
        unique_identifiers = {"class": "BenchmarkTokenizer"}

    torch.distributed.get_rank = lambda *a, **k: 0  # BlendedDataset asks even without a group
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, blend=([prefix], None), split=SPLIT,
        path_to_cache=cache, tokenizer=Tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False,
    )  # fmt: skip
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the synthetic corpus goes")
    parser.add_argument("--megatron", action="store_true", help="also time megatron-core")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    args = parser.parse_args()

    if args.megatron:  # imported before the clock starts: its import alone takes seconds
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpt_index_build_"))
    work.mkdir(parents=True, exist_ok=True)
    prefix = str(work / "corpus_text_document")
    try:
        seconds, documents = timed(write_corpus, Path(prefix), args.tokens)
        print(f"corpus: {documents:,} documents, {args.tokens:,} tokens ({seconds:.1f} s to write)")
        per_epoch = (int(args.tokens * 0.969) - 1) // SEQ_LENGTH
        rows = []
        for label, train in (("1 epoch", per_epoch), ("3 epochs", 2 * per_epoch + per_epoch // 2)):
            sizes = requested(train)
            cache = str(work / f"cache-{label.replace(' ', '-')}")
            build_s, built = timed(mega_build, prefix, cache, sizes)
            assert {p.cache for p in built.parts} == {"built"}
            reload_s, again = timed(mega_build, prefix, cache, sizes)
            assert {p.cache for p in again.parts} == {"loaded"}
            fresh_s = reload_in_fresh_process(prefix, cache, sizes)
            row = {
                "train_samples_requested": sizes[0],
                "valid_samples_requested": sizes[1],
                "test_samples_requested": sizes[2],
                "label": label,
                "train_samples_built": len(built.splits[0]),
                "train_epochs": built.parts[0].epochs,
                "build_s": round(build_s, 3),
                "reload_s": round(reload_s, 4),
                "reload_fresh_process_s": round(fresh_s, 4),
                "under_targets": build_s < TARGET_BUILD_S
                and max(reload_s, fresh_s) < TARGET_RELOAD_S,
            }
            if args.megatron:
                mcache = str(work / f"mcache-{label.replace(' ', '-')}")
                mega_s, ref = timed(megatron_build, prefix, mcache, sizes)
                row["megatron_core_build_s"] = round(mega_s, 3)
                same = True
                for mine, theirs in zip(built.splits, ref, strict=True):
                    for name in ("document_index", "sample_index", "shuffle_index"):
                        a, b = getattr(mine, name), getattr(theirs, name)
                        same &= a.dtype == b.dtype and np.array_equal(a, b)
                row["equal_to_megatron_core"] = bool(same)
            rows.append(row)
            print(
                f"{label:9s} train {row['train_samples_built']:,} samples ({row['train_epochs']}"
                f" epochs): build {build_s:.2f} s, reload {reload_s * 1000:.1f} ms,"
                f" fresh-process reload {fresh_s * 1000:.0f} ms"
                + (
                    f"; megatron-core {row['megatron_core_build_s']:.2f} s,"
                    f" equal: {row['equal_to_megatron_core']}"
                    if args.megatron
                    else ""
                )
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("mega", "numpy", "megatron-core"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            pass
    today = datetime.date.today().isoformat()
    from result_file import with_provenance  # the date, commit, device, versions

    result = with_provenance(
        {
            "date": today,
            "command": " ".join([sys.executable, *sys.argv]),
            "python": platform.python_version(),
            "machine": {
                "arch": platform.machine(),
                "cpu": _cpu_model(),
                "cores": os.cpu_count(),
                "system": platform.platform(),
            },
            "versions": versions,
            "corpus": {
                "tokens": args.tokens,
                "documents": documents,
                "lengths": "lognormal(mean 1000, sigma 1.0)",
                "bin": "sparse uint16",
            },
            "seq_length": SEQ_LENGTH,
            "split": SPLIT,
            "seed": SEED,
            "targets_s": {"build": TARGET_BUILD_S, "reload": TARGET_RELOAD_S},
            "results": rows,
        }
    )
    out = Path(__file__).parent / "results" / f"gpt_index_build_{today}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not all(row["under_targets"] for row in rows):
        sys.exit(1)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
