"""Render result files (benchmarks/results/*.json) as Markdown pages for the docs site.

    python benchmarks/render_results.py benchmarks/results/NAME.json [...] --out docs/results

Each page: where the numbers came from (date, commit, device, versions, the command), the file's
``note`` if it has one, whether mega's code has changed since the measured commit (as of the
commit the page is rendered at), and the file's rows as a table of their plain fields (text, numbers, flags; nested fields stay
in the JSON, which the page names).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def freshness(commit: str | None) -> str:
    """One line: whether ``mega/`` changed between ``commit`` and this checkout's HEAD."""
    if not commit:
        return "The file does not record the commit it measured."
    measured = commit.removesuffix("+dirty")
    head = _git("rev-parse", "--short", "HEAD").stdout.strip()
    changed = _git("diff", "--quiet", measured, "HEAD", "--", "mega")
    if changed.returncode > 1 or not head:  # an unknown commit (another clone's, rebased away)
        return f"Measured at {commit}, which this checkout does not have."
    if changed.returncode == 0:
        return f"Measured at {commit}; `mega/` is unchanged since (rendered at {head})."
    count = _git("rev-list", "--count", f"{measured}..HEAD", "--", "mega").stdout.strip()
    return (
        f"Measured at {commit}; **older than the code**: {count} commits have changed `mega/`"
        f" since (rendered at {head})."
    )


def _plain(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value).replace("|", "\\|")


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of ``rows``' plain fields (the first row's order, then new ones), less
    the long ``command``."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if _plain(v) and k not in columns and k != "command"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return lines


def render(path: Path) -> str:
    """The page of the result file ``path``."""
    data = json.loads(path.read_text())
    lines = [f"# {path.stem}", ""]
    lines += [freshness(data.get("commit")), ""]
    versions = ", ".join(f"{k} {v}" for k, v in (data.get("versions") or {}).items())
    facts = [
        ("date", data.get("date")),
        ("device", f"{data.get('device')}" + (f" x {data['gpus']}" if data.get("gpus") else "")),
        ("versions", versions),
        ("file", f"`benchmarks/results/{path.name}`"),
    ]
    lines += [f"- {name}: {value}" for name, value in facts if value]
    if data.get("command"):
        lines += ["", "```", data["command"], "```"]
    if data.get("note"):  # what the run showed, in the measurer's words
        lines += ["", str(data["note"])]
    rows = data.get("results")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        lines += ["", *table(rows)]
        nested = sorted({k for r in rows for k, v in r.items() if not _plain(v)})
        if nested:
            lines += ["", "In the JSON only: " + ", ".join(f"`{k}`" for k in nested) + "."]
    elif isinstance(rows, dict):
        lines += ["", *table([rows])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="result files (JSON)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.files:
        page = args.out / f"{path.stem}.md"
        page.write_text(render(path))
        print(f"wrote {page}")


if __name__ == "__main__":
    main()
