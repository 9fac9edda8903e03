"""FP8 against bf16 on real text: the 1.3B GPT trained twice from the same initialisation on the
same batches, once with ``--fp8-format``, the loss curves compared and plotted.

    python benchmarks/fp8_convergence.py prepare --out .scratch/fp8corpus    # any machine, offline
    python benchmarks/fp8_convergence.py train --corpus .scratch/fp8corpus   # one Hopper GPU
        [--fp8 fp8="--fp8-format hybrid" --fp8 delayed="--fp8-format hybrid --fp8-recipe delayed"]
    python benchmarks/fp8_convergence.py report --curves RUNS/curves.json    # result + PNG

``prepare`` needs no network: the corpus is the Python standard library's own source (code,
docstrings and comments of every module outside its tests: real text of ~4M GPT-2 tokens), one
document per file; it trains a GPT-2 byte-level BPE tokenizer on it (the Hugging Face
``tokenizers`` library, 50,257 entries with ``<|endoftext|>``, GPT-2's file format) and runs
``mega preprocess`` with it. ``train`` runs ``mega train`` in bf16, then once per ``--fp8
NAME=FLAGS`` (default ``fp8="--fp8-format hybrid"``), with the flags below, and collects the runs'
iteration numbers into ``curves.json``. ``report`` compares each FP8 run's final loss with bf16's
(the mean of the last ``--final-window`` iterations: one step's loss depends on its batch, and all
runs see the same batches) and writes ``benchmarks/results/<name>_<date>.json`` (``--name``,
default ``fp8_convergence``) and a PNG of the curves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

MODEL = (
    "--model gpt --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048"
    " --max-position-embeddings 2048 --hidden-dropout 0 --attention-dropout 0"
)
TRAIN = (
    "--bf16 --micro-batch-size 4 --global-batch-size 8 --train-iters 300 --lr 3e-4"
    " --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.1"
    " --clip-grad 1.0 --adam-beta2 0.95 --log-interval 1 --eval-iters 0 --seed 1234"
)
VOCAB_SIZE = 50257


def prepare(out: Path) -> None:
    """Corpus JSONL, GPT-2 BPE files and the indexed dataset under ``out``."""
    from tokenizers import ByteLevelBPETokenizer

    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if not {"test", "tests", "site-packages", "idlelib"} & set(p.relative_to(stdlib).parts)
    )
    corpus = out / "corpus.jsonl"
    with corpus.open("w") as f:
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            f.write(json.dumps({"text": text}) + "\n")
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(p) for p in files], vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"])
    vocab, merges = bpe.save_model(str(out))
    subprocess.run(
        [
            "mega", "preprocess", "--input", str(corpus), "--output-prefix", str(out / "stdlib"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
            "--append-eod",
        ],
        check=True,
    )  # fmt: skip
    corpus.unlink()  # the indexed dataset is what travels
    info = {"source": str(stdlib), "python": platform.python_version(), "files": len(files)}
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"prepared {out}: {info}")


def train_argv(corpus: Path, run_dir: Path, fp8_flags: str) -> list[str]:
    return [
        "mega", "train", *shlex.split(MODEL), *shlex.split(TRAIN),
        "--data-path", str(corpus / "stdlib_text_document"), "--split", "100,0,0",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(corpus / "vocab.json"),
        "--merge-file", str(corpus / "merges.txt"), "--run-dir", str(run_dir),
        *shlex.split(fp8_flags),
    ]  # fmt: skip


def train(corpus: Path, runs: Path, fp8_runs: dict[str, str]) -> None:
    """bf16 then each FP8 run, then ``curves.json``: each run's command and per-iteration
    numbers, one small file to carry back from the GPU machine."""
    runs_data = {}
    for name, flags in {"bf16": "", **fp8_runs}.items():
        argv = train_argv(corpus, runs / name, flags)
        subprocess.run(argv, check=True)
        lines = (runs / name / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        runs_data[name] = {"command": shlex.join(argv), "iterations": iteration_rows(rows)}
    corpus_info = json.loads((corpus / "corpus.json").read_text())
    curves = {"corpus": corpus_info, "runs": runs_data}
    (runs / "curves.json").write_text(json.dumps(curves) + "\n")


def iteration_rows(rows: list[dict]) -> list[dict]:
    keys = ("iteration", "lm_loss", "tokens_per_s", "grad_norm")
    return [{k: r[k] for k in keys if k in r} for r in rows if "lm_loss" in r]


def report(curves_path: Path, out: Path, window: int, name: str) -> None:
    saved = json.loads(curves_path.read_text())
    curves = saved["runs"]
    losses = {n: [r["lm_loss"] for r in c["iterations"]] for n, c in curves.items()}
    final = {n: sum(v[-window:]) / len(v[-window:]) for n, v in losses.items()}
    speed = {
        n: _median([r.get("tokens_per_s") for r in c["iterations"]]) for n, c in curves.items()
    }
    date = datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{name}_{date}.png"
    plot(curves, png)
    from result_file import with_provenance  # the date, commit, device, versions

    result = with_provenance(
        {
            "date": date,
            "commands": {n: c["command"] for n, c in curves.items()},
            "corpus": saved["corpus"],
            "curves_source": saved.get("source", "metrics.jsonl of each run"),
            "final_window": window,
            "final_loss": {n: round(v, 5) for n, v in final.items()},
            **{
                f"{n}_vs_bf16_final_loss_rel_diff": round(
                    (final[n] - final["bf16"]) / final["bf16"], 5
                )
                for n in final
                if n != "bf16"
            },
            "last_iteration_loss": {n: v[-1] for n, v in losses.items()},
            "median_tokens_per_s": speed,
            "losses": losses,
            "plot": png.name,
        }
    )
    path = out / f"{name}_{date}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
    print(f"wrote {path} and {png}")


def plot(curves: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, tail) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        its = [r["iteration"] for r in c["iterations"]]
        loss = [r["lm_loss"] for r in c["iterations"]]
        full.plot(its, loss, label=name, linewidth=1)
        tail.plot(its[len(its) // 2 :], loss[len(its) // 2 :], label=name, linewidth=1)
    full.set(xlabel="iteration", ylabel="lm loss", title="1.3B GPT, bf16 vs FP8")
    tail.set(xlabel="iteration", title="second half")
    full.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _median(values: list) -> float | None:
    values = sorted(v for v in values[5:] if v)  # past the compile-heavy first steps
    return values[len(values) // 2] if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train")
    t.add_argument("--corpus", type=Path, required=True)
    t.add_argument("--runs", type=Path, default=Path(os.environ.get("OUT", ".")) / "fp8_runs")
    t.add_argument(
        "--fp8",
        action="append",
        metavar="NAME=FLAGS",
        help='an FP8 run and its mega train flags (repeatable); default fp8="--fp8-format hybrid"',
    )
    r = sub.add_parser("report")
    r.add_argument("--curves", type=Path, required=True, help="train's curves.json")
    r.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    r.add_argument("--final-window", type=int, default=20)
    r.add_argument("--name", default="fp8_convergence", help="the result files' name")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out)
    elif args.command == "train":
        specs = args.fp8 or ["fp8=--fp8-format hybrid"]
        if any("=" not in spec for spec in specs):
            parser.error("--fp8 takes NAME=FLAGS")
        fp8_runs = dict(spec.split("=", 1) for spec in specs)
        if "bf16" in fp8_runs or any(not n for n in fp8_runs):
            parser.error("--fp8 NAME=FLAGS: NAME must be given and must not be bf16")
        train(args.corpus, args.runs, fp8_runs)
    else:
        report(args.curves, args.out, args.final_window, args.name)


if __name__ == "__main__":
    sys.exit(main())
