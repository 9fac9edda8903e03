"""The documentation site builds in strict mode (a broken link or anchor, a page left out of the
nav, fails) and the generated flag reference is what the code says."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_flag_reference_matches_the_code():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "flag_reference.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_the_site_builds_strictly(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "reference" / "train-flags" / "index.html").exists()


def test_a_broken_link_fails_the_strict_build(tmp_path: Path):
    """The check above can fail: the same build with one page linking to a missing page."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](missing.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: x\nstrict: true\n")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "missing.md" in result.stderr


def documented_commands(*names: str) -> list[tuple[str, list[str]]]:
    """Every ``mega NAME ...`` line of a shell block in README.md and docs/ (continuation lines
    joined, comments dropped), as (where, its words after ``mega``)."""
    found: list[tuple[str, list[str]]] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        in_block, shell, pending = False, False, ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_block, shell = not in_block, line[3:].strip() in ("bash", "sh", "")
                continue
            if not (in_block and shell):
                continue
            text = "" if line.lstrip().startswith("#") else line.split(" # ")[0].rstrip()
            part = text.removesuffix("\\").strip()
            joined = f"{pending} {part}" if pending else part
            if pending or joined.startswith("mega "):
                if text.endswith("\\"):
                    pending = joined
                    continue
                pending = ""
                words = shlex.split(joined)[1:]
                if words and words[0] in names:
                    found.append((f"{path.relative_to(ROOT)}:{number}", words))
    return found


# What a documented command may lack on a machine of the suite: the files it names, a GPU, the
# example plugin's registrations. A flag that does not exist, or a value of the wrong type, is
# what docs drift looks like.
DRIFT = ("unknown flag", "flag --", "unexpected argument")


def test_every_documented_train_command_uses_flags_that_exist():
    from mega.core.config.resolve import resolve_config
    from mega.core.plugins.manager import make_plugins
    from mega.errors import MegaUsageError

    plugins = make_plugins()
    commands = documented_commands("train")
    assert len(commands) >= 20  # the extraction itself works
    drifted = []
    for where, words in commands:
        args = [w for w in words[1:] if w != "..."]  # "..." stands for the reader's own flags
        if "--help" in args or (
            ("--model" in args) and args[args.index("--model") + 1] not in plugins.models
        ):
            continue  # a plugin's model (docs/plugins.md): tests/test_third_party_plugin.py runs it
        try:
            resolve_config(args, plugins)
        except MegaUsageError as error:
            problems = [p for p in str(error).split("; ") if p.startswith(DRIFT)]
            problems = [p for p in problems if "'...'" not in p]
            if problems:
                drifted.append(f"{where}: {problems}")
    assert not drifted, "\n".join(drifted)


def test_every_relative_link_of_the_readme_resolves():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing
