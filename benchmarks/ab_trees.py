"""A/B one benchmark script between two source trees of mega in one run on one machine: was a
change (a refactor, say) free of speed cost? Each repeat installs each tree in turn
(``pip install --no-deps -e TREE``) and runs the script from it, alternating the order, so drift
of the machine falls on both sides.

    python benchmarks/ab_trees.py --old ../mega-old --new . --repeats 2 \
        -- gpt_throughput.py --systems mega
    python benchmarks/ab_trees.py --old ../mega-old --new . -- parallel_layouts.py \
        --layouts pp2v2-interleaved --base pp2v2-interleaved

A tree without the script uses the new one's (it then measures whichever mega is installed, as
quickstart_speed.py does). The script must accept ``--out DIR`` and ``--name NAME`` and write ``DIR/NAME_<date>.json`` with a
``results`` list whose rows carry ``tokens_per_s`` (gpt_throughput.py and parallel_layouts.py
do). Writes ``benchmarks/results/ab_trees_<date>.json`` (or ``--out``): the command, the two
trees' commits, every run's rows, and new/old of the median tokens/s per row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from result_file import with_provenance


def commit_of(tree: Path) -> str:
    """The tree's commit: its COMMIT file (a tree exported without .git), else git's description
    when the tree is a checkout's top level (``-dirty`` when it has changes)."""
    stamp = tree / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    top = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != tree.resolve():
        return "unknown"
    done = subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def install(tree: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--disable-pip-version-check", "-e", str(tree)],
        check=True,
    )


def run(tree: Path, script: list[str], name: str, out: Path) -> list[dict]:
    """Run the benchmark from ``tree``; its result rows, each with a ``key`` naming the row."""
    path = tree / "benchmarks" / script[0]
    if not path.is_file():  # a script newer than the old tree: it measures the installed mega
        path = Path(__file__).parent / script[0]
    command = [sys.executable, str(path), *script[1:]]
    command += ["--out", str(out), "--name", name]
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, cwd=tree, check=True)
    (result_file,) = out.glob(f"{name}_*.json")
    rows = json.loads(result_file.read_text())["results"]
    for row in rows:
        row["key"] = row.get("system") or row.get("layout") or "?"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="ab_trees")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = ["old", "new"] if repeat % 2 == 0 else ["new", "old"]
            for side in order:
                install(trees[side])
                out = Path(scratch, f"{side}{repeat}")
                out.mkdir()
                runs[side].append(run(trees[side], script, f"{side}{repeat}", out))
    install(trees["new"])
    summary = {}
    for key in {row["key"] for row in runs["new"][0]}:
        medians = {
            side: statistics.median(
                row["tokens_per_s"] for rows in runs[side] for row in rows if row["key"] == key
            )
            for side in runs
        }
        summary[key] = {**medians, "new_over_old": medians["new"] / medians["old"]}
        print(
            f"{key}: old {medians['old']:,.0f} tokens/s, new {medians['new']:,.0f}:"
            f" new/old {summary[key]['new_over_old']:.4f}"
        )
    import torch

    # this driver imports no mega (provenance() finds none on its path): the new tree's, as
    # installed last, from a fresh interpreter
    version = subprocess.run(
        [sys.executable, "-c", "import mega; print(mega.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    record = with_provenance({
        "versions": {"mega": version or None},
        "commit": commit_of(trees["new"]),  # the newer code measured; both trees below
        "command": shlex.join(sys.argv),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor(),
        "trees": {
            side: {"path": str(tree), "commit": commit_of(tree)} for side, tree in trees.items()
        },
        "summary": summary,
        "runs": runs,
    })  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}_{record['date']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
