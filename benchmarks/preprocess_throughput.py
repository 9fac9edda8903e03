"""`mega preprocess` throughput and memory against raw Hugging Face `tokenizers` batch encoding.

    python benchmarks/preprocess_throughput.py                 # 100 MB and 1 GB, writes results/
    python benchmarks/preprocess_throughput.py --sizes 100M    # quicker, 100 MB only
    python benchmarks/preprocess_throughput.py --prepare-only  # build the corpus and BPE only

Everything is local and cached under ``--workdir`` (default /tmp/mega-preprocess-bench):

- **Corpus**: English text from this Python's own library (``pydoc_data`` topics, the docstrings
  and the sources of every stdlib ``.py``), cut into paragraphs at blank lines (paragraphs over
  20,000 characters, i.e. data tables, dropped); each JSONL document joins 1 to 60 shuffled
  paragraphs (log-normal count), so documents range from one line to a few hundred KB.
  ``corpus_1g.jsonl`` is >= 1 GB; ``corpus_100m.jsonl`` is its first 100 MB.
- **Tokenizer**: a GPT-2 byte-level BPE (vocab 32,000 + ``<|endoftext|>``) trained with
  ``tokenizers`` on 30 MB of the same paragraphs, saved as ``vocab.json`` + ``merges.txt``.

Measured:

- **raw** (the baseline): ``tokenizers.Tokenizer.encode_batch`` over the 100 MB corpus's texts,
  already in memory, in batches of 1,000 documents, Rust's thread pool on (the library default:
  both cores). Only the encode calls are timed: MB/s of text, and MB per CPU-second. Reference
  points for the design: one thread; two processes of one thread (half the documents each); and
  ``encode_batch_fast`` (no character offsets), which the GPT2BPETokenizer plugin calls.
- **mega preprocess** end to end (``--tokenizer-type GPT2BPETokenizer --append-eod``): input
  bytes / wall-clock seconds of the whole command (Python start-up, plugin discovery, reading,
  JSON, tokenizing, writing, fsync), its CPU time (``wait4`` rusage, workers included), and the
  memory of its process tree sampled from /proc every 0.1 s: peak / 95th percentile / median of
  the summed RSS, peak of the summed PSS (shared pages counted once), the parent's own RSS at 10%
  of the run and at the end (its index arrays grow with the document count), and the largest
  single process's ``ru_maxrss``.
- Runs: the baseline and the default 100 MB run alternate ``--repeats`` times (the machine may be
  shared: the best and the median of each are compared), then the reference points, ``--workers
  1`` on 100 MB (one worker letting Rust use both cores), and the 1 GB run.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

MB = 1_000_000
SIZES = {"100M": 100 * MB, "1G": 1_000 * MB}
RAW_BATCH_DOCS = 1000
# Longer "paragraphs" are data tables and generated code (a few stdlib files have 800 KB without
# a blank line), not text; keeping them would make the largest document, which sets the
# tokenizer's peak memory, depend on how many times the generator happens to draw one.
MAX_PARAGRAPH_CHARS = 20_000
CORPUS_VERSION = 2  # bump when the corpus recipe changes: cached files are rebuilt
VOCAB_SIZE = 32_000
EOD = "<|endoftext|>"


# ----------------------------------------------------------------------------- corpus


def stdlib_paragraphs() -> list[str]:
    """Paragraphs of English-ish text from the local Python installation."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics

        texts.extend(topics.values())
    except ImportError:
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(source)  # code and comments: whitespace runs, punctuation, identifiers
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    paragraphs = []
    for text in texts:
        for paragraph in text.split("\n\n"):
            paragraph = paragraph.strip("\n")
            if paragraph.strip() and len(paragraph) <= MAX_PARAGRAPH_CHARS:
                paragraphs.append(paragraph)
    return paragraphs


def build_corpus(workdir: Path) -> dict[str, Path]:
    """corpus_1g.jsonl (>= 1 GB) and corpus_100m.jsonl (its first 100 MB); reused when present."""
    paths = {"100M": workdir / "corpus_100m.jsonl", "1G": workdir / "corpus_1g.jsonl"}
    done = workdir / "corpus.done"
    if done.exists() and all(p.exists() for p in paths.values()):
        if json.loads(done.read_text()).get("version") == CORPUS_VERSION:
            return paths
    start = time.perf_counter()
    paragraphs = stdlib_paragraphs()
    rng = random.Random(1234)
    small_left = SIZES["100M"]
    written = 0
    docs = 0
    with open(paths["1G"], "w") as big, open(paths["100M"], "w") as small:
        while written < SIZES["1G"]:
            n = min(int(rng.lognormvariate(1.6, 1.0)) + 1, 60)
            text = "\n\n".join(rng.choice(paragraphs) for _ in range(n))
            line = json.dumps({"id": docs, "text": text}) + "\n"
            big.write(line)
            written += len(line)
            if len(line) <= small_left:
                small.write(line)
                small_left -= len(line)
            else:
                small_left = 0  # a contiguous prefix: stop at the first line that does not fit
            docs += 1
    done.write_text(json.dumps({"docs": docs, "bytes": written, "version": CORPUS_VERSION}))
    print(
        f"corpus: {docs:,} docs, {written / MB:.0f} MB from {len(paragraphs):,} paragraphs"
        f" in {time.perf_counter() - start:.0f} s"
    )
    return paths


def train_bpe(workdir: Path) -> tuple[Path, Path]:
    """A GPT-2 style byte-level BPE trained on local text; reused when present."""
    vocab, merges = workdir / "vocab.json", workdir / "merges.txt"
    done = workdir / "bpe.done"
    if vocab.exists() and merges.exists() and done.exists():
        if json.loads(done.read_text()).get("version") == CORPUS_VERSION:
            return vocab, merges
    from tokenizers import ByteLevelBPETokenizer

    start = time.perf_counter()
    paragraphs = stdlib_paragraphs()
    rng = random.Random(0)
    rng.shuffle(paragraphs)
    sample, size = [], 0
    for paragraph in paragraphs:
        sample.append(paragraph)
        size += len(paragraph)
        if size > 30 * MB:
            break
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(
        sample, vocab_size=VOCAB_SIZE + 1, min_frequency=2, special_tokens=[EOD]
    )
    tokenizer.save_model(str(workdir))
    done.write_text(json.dumps({"version": CORPUS_VERSION}))
    print(f"BPE: vocab {tokenizer.get_vocab_size()} trained in {time.perf_counter() - start:.0f} s")
    return vocab, merges


# ----------------------------------------------------------------------------- raw tokenizers


RAW_SCRIPT = r"""
import json, sys, time
from tokenizers import ByteLevelBPETokenizer
vocab, merges, corpus, part, parts, method = sys.argv[1:7]
part, parts = int(part), int(parts)
texts = []
with open(corpus, "rb") as f:
    for i, line in enumerate(f):
        if i % parts == part:
            texts.append(json.loads(line)["text"])
tok = ByteLevelBPETokenizer.from_file(vocab, merges)._tokenizer  # the Rust Tokenizer itself
nbytes = sum(len(t.encode("utf-8")) for t in texts)
print("READY", flush=True)
sys.stdin.readline()  # start together with the other processes
encode = getattr(tok, method)
tokens, seconds, cpu = 0, 0.0, 0.0
for i in range(0, len(texts), BATCH):
    batch = texts[i : i + BATCH]
    start, cpu_start = time.perf_counter(), time.process_time()
    encodings = encode(batch)
    seconds += time.perf_counter() - start
    cpu += time.process_time() - cpu_start
    tokens += sum(len(e.ids) for e in encodings)
print(json.dumps({"bytes": nbytes, "seconds": seconds, "cpu": cpu, "tokens": tokens}))
""".replace("BATCH", str(RAW_BATCH_DOCS))


def raw_encode(
    vocab: Path,
    merges: Path,
    corpus: Path,
    processes: int,
    threads: bool,
    method: str = "encode_batch",
) -> dict:
    """Raw ``encode_batch`` MB/s; ``processes`` > 1 splits the documents between processes."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true" if threads else "false"}
    load = os.getloadavg()[0]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RAW_SCRIPT,
                str(vocab),
                str(merges),
                str(corpus),
                str(i),
                str(processes),
                method,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in range(processes)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "READY"
    wall_start = time.perf_counter()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [json.loads(proc.communicate()[0]) for proc in procs]
    wall = time.perf_counter() - wall_start
    total = sum(r["bytes"] for r in results)
    encode_seconds = max(r["seconds"] for r in results)
    return {
        "method": f"Tokenizer.{method}",
        "processes": processes,
        "rust_threads": "all cores" if threads else 1,
        "load_average_before": round(load, 2),
        "cpu_seconds": round(sum(r["cpu"] for r in results), 2),
        "MB_per_cpu_s": round(total / MB / sum(r["cpu"] for r in results), 2),
        "text_bytes": total,
        "tokens": sum(r["tokens"] for r in results),
        "encode_seconds": round(encode_seconds, 2),
        "MB_per_s": round(total / MB / encode_seconds, 2),
        "wall_seconds_incl_ids": round(wall, 2),
    }


# ----------------------------------------------------------------------------- mega preprocess


def tree_memory(root: int) -> dict[str, int]:
    """RSS and PSS in bytes of ``root`` alone and of its whole process tree."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out = {"rss": 0, "pss": 0, "parent_rss": 0}
    stack = [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Rss:", "Pss:")):
                        value = int(line.split()[1]) * 1024
                        out[line[:3].lower()] += value
                        if pid == root and line.startswith("Rss:"):
                            out["parent_rss"] = value
        except OSError:
            continue
    return out


def run_preprocess(args: list[str], input_bytes: int, workdir: Path) -> dict:
    """Run ``mega preprocess``; sample its process tree's memory; its CPU time from wait4."""
    command = [sys.executable, "-m", "mega", "preprocess", *args]
    samples: list[dict[str, int]] = []
    load = os.getloadavg()[0]
    out_path, err_path = workdir / "preprocess.out", workdir / "preprocess.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append(tree_memory(proc.pid))
                stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # usage covers the workers it joined
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        stop.set()
        sampler.join()
    if proc.returncode != 0:
        sys.exit(f"mega preprocess failed ({proc.returncode}):\n{err_path.read_text()}")
    cpu = usage.ru_utime + usage.ru_stime
    steady = samples[len(samples) // 10 :]  # from 10% of the run on: start-up excluded

    def mb(key: str, q: float = 1.0) -> float:
        values = sorted(sample[key] for sample in steady)
        return round(values[min(len(values) - 1, int(q * len(values)))] / MB, 1)

    return {
        "command": "mega preprocess " + " ".join(args),
        "input_bytes": input_bytes,
        "load_average_before": round(load, 2),
        "wall_seconds": round(wall, 2),
        "MB_per_s": round(input_bytes / MB / wall, 2),
        "cpu_seconds": round(cpu, 2),
        "MB_per_cpu_s": round(input_bytes / MB / cpu, 2),
        "peak_tree_rss_MB": round(max(sample["rss"] for sample in samples) / MB, 1),
        "peak_tree_pss_MB": round(max(sample["pss"] for sample in samples) / MB, 1),
        "median_tree_rss_MB": mb("rss", 0.5),
        "p95_tree_rss_MB": mb("rss", 0.95),
        "parent_rss_MB_at_10pct_and_end": [
            round(steady[0]["parent_rss"] / MB, 1),
            round(steady[-1]["parent_rss"] / MB, 1),
        ],
        "memory_samples": len(samples),
        "largest_process_maxrss_MB": round(usage.ru_maxrss * 1024 / MB, 1),
        "summary": out_path.read_text().strip().splitlines(),
    }


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_GiB": round(memory / 2**30, 1),
        "platform": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mega-preprocess-bench")
    parser.add_argument("--sizes", default="100M,1G", help="comma-separated: 100M, 1G")
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3, help="baseline and 100M runs, each")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--no-save", action="store_true", help="print, do not write results/")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpora = build_corpus(workdir)
    vocab, merges = train_bpe(workdir)
    if args.prepare_only:
        return

    def raw(processes=1, threads=True, method="encode_batch") -> dict:
        row = raw_encode(vocab, merges, corpora["100M"], processes, threads, method)
        print(
            f"raw {method}, {processes} process(es), rust threads {row['rust_threads']}:"
            f" {row['MB_per_s']:.2f} MB/s ({row['MB_per_cpu_s']:.2f} MB per CPU-s)"
        )
        return row

    def preprocess(size: str, workers: int) -> dict:
        corpus = corpora[size]
        out = workdir / f"out_{size.lower()}"
        flags = [
            "--input", str(corpus), "--output-prefix", str(out),
            "--tokenizer-type", args.tokenizer_type,
            "--vocab-file", str(vocab), "--merge-file", str(merges),
            "--append-eod", "--workers", str(workers),
        ]  # fmt: skip
        row = run_preprocess(flags, corpus.stat().st_size, workdir)
        row.update(size=size, workers=workers)
        print(
            f"mega preprocess {size} --workers {workers}: {row['MB_per_s']:.2f} MB/s"
            f" ({row['MB_per_cpu_s']:.2f} MB per CPU-s), tree RSS peak"
            f" {row['peak_tree_rss_MB']} MB / p95 {row['p95_tree_rss_MB']} MB /"
            f" median {row['median_tree_rss_MB']} MB, PSS peak {row['peak_tree_pss_MB']} MB,"
            f" parent {row['parent_rss_MB_at_10pct_and_end']} MB"
        )
        for suffix in (".bin", ".idx"):
            Path(f"{out}_text_document{suffix}").unlink(missing_ok=True)
        return row

    # The machine may be shared: the baseline and mega's default run alternate, repeated, and
    # the best of each is compared (the least disturbed run), with medians alongside.
    baseline_runs, default_runs = [], []
    for _ in range(args.repeats):
        baseline_runs.append(raw())
        default_runs.append(preprocess("100M", args.workers))
    reference = [
        raw(threads=False),
        raw(processes=2, threads=False),
        raw(method="encode_batch_fast"),
    ]
    other = [preprocess("100M", 1)] if args.workers != 1 else []
    large = [preprocess(size, args.workers) for size in args.sizes.split(",") if size != "100M"]

    def best(rows):
        return max(rows, key=lambda r: r["MB_per_s"])

    def median(rows):
        return statistics.median(r["MB_per_s"] for r in rows)

    base, e2e = best(baseline_runs), best(default_runs)
    comparison = {
        "raw_encode_batch_best_MB_per_s": base["MB_per_s"],
        "preprocess_100M_best_MB_per_s": e2e["MB_per_s"],
        "fraction_best": round(e2e["MB_per_s"] / base["MB_per_s"], 3),
        "raw_encode_batch_median_MB_per_s": median(baseline_runs),
        "preprocess_100M_median_MB_per_s": median(default_runs),
        "fraction_median": round(median(default_runs) / median(baseline_runs), 3),
        "fraction_per_cpu_second": round(e2e["MB_per_cpu_s"] / base["MB_per_cpu_s"], 3),
    }
    if large:
        comparison["preprocess_1G_MB_per_s"] = large[-1]["MB_per_s"]
        comparison["fraction_1G"] = round(large[-1]["MB_per_s"] / base["MB_per_s"], 3)
        for key in (
            "peak_tree_rss_MB",
            "p95_tree_rss_MB",
            "median_tree_rss_MB",
            "peak_tree_pss_MB",
        ):
            comparison[f"{key}_100M_vs_1G"] = [e2e[key], large[-1][key]]
        comparison["parent_rss_MB_at_10pct_and_end_1G"] = large[-1][
            "parent_rss_MB_at_10pct_and_end"
        ]
    print(json.dumps(comparison, indent=2))

    from importlib.metadata import version

    today = datetime.date.today().isoformat()
    from result_file import with_provenance  # the date, commit, device, versions

    result = with_provenance(
        {
            "date": today,
            "command": " ".join([sys.executable, *sys.argv]),
            "python": platform.python_version(),
            "machine": machine(),
            "versions": {p: version(p) for p in ("mega", "tokenizers", "numpy")},
            "corpus": {
                size: {"path": str(p), "bytes": p.stat().st_size} for size, p in corpora.items()
            },
            "tokenizer": {"type": args.tokenizer_type, "vocab": str(vocab), "merges": str(merges)},
            "comparison": comparison,
            "raw_encode_batch_baseline_runs": baseline_runs,
            "raw_reference_runs": reference,
            "preprocess_100M_runs": default_runs,
            "preprocess_other_runs": other + large,
            "target": "end-to-end MB/s >= 0.8 x raw encode_batch MB/s; RSS flat from 100 MB to 1 GB",
        }
    )
    if not args.no_save:
        path = Path(__file__).parent / "results" / f"preprocess_throughput_{today}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
