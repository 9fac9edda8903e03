"""The fenced code blocks of README.md and docs/ (tests/test_doc_snippets.py runs them).

A block runs unless the line just above its fence says otherwise:

    <!-- snippet: not run: WHY -->        (a fragment, a GPU run, a file the reader supplies, ...)
    <!-- snippet: torchrun N -->          (a Python block for N processes: gloo on the CPU)

Plain blocks (no language: output, diagrams) are text; ``toml`` blocks must parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(
    r"(?:<!-- snippet: (?P<marker>[^>]*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)```", re.S
)


@dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    body: str
    marker: str  # "" when the block runs as it is

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def documents() -> list[Path]:
    """README.md and the docs' own pages (not the generated ones under docs/results and
    docs/reference)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets() -> list[Snippet]:
    found = []
    for doc in documents():
        text = doc.read_text()
        for m in FENCE.finditer(text):
            fence_line = text[: m.start("lang")].count("\n") + 1
            found.append(
                Snippet(
                    str(doc.relative_to(ROOT)), fence_line, m["lang"], m["body"], m["marker"] or ""
                )
            )
    return found


def runnable(lang: str) -> list[Snippet]:
    """The blocks of ``lang`` that run as they are (no marker)."""
    return [s for s in snippets() if s.lang == lang and not s.marker]


def _call_registrations(namespace: dict) -> None:
    """Call every ``register_*`` hook implementation the block defined with a ``register`` that
    drops what it gets, so the specs it builds are built (a renamed field fails here, not only
    an import)."""
    for name, value in list(namespace.items()):
        if name.startswith("register_") and callable(value):
            value(lambda *specs, **kw: None)


def run_python_blocks() -> int:
    """Each runnable Python block in a fresh namespace (in the current directory); prints ``ok
    WHERE`` or ``FAIL WHERE`` with the traceback. The number that failed."""
    import sys
    import traceback
    import types

    failed = 0
    for index, snippet in enumerate(runnable("python")):
        # a module of its own, as a file would be (dataclasses look their module up)
        module = types.ModuleType(f"snippet_{index}")
        sys.modules[module.__name__] = module
        try:
            exec(compile(snippet.body, snippet.where, "exec"), module.__dict__)
            _call_registrations(module.__dict__)
        except BaseException:  # noqa: BLE001 - reported with the block's place
            failed += 1
            print(f"FAIL {snippet.where}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"ok {snippet.where}", flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(1 if run_python_blocks() else 0)
