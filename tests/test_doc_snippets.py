"""Every code block of README.md and docs/ runs, or says on the line above it why not
(tests/doc_snippets.py: the markers). Python blocks run in fresh namespaces with the example
plugin package importable; a ``torchrun N`` block runs on N gloo processes; the bash blocks that
run need nothing but mega; ``toml`` blocks parse."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from doc_snippets import ROOT, runnable, snippets

EXAMPLE = ROOT / "tests" / "plugin_pkgs" / "mega-plugin-example"
MARKERS = ("not run: ", "torchrun ")


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(EXAMPLE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_every_code_block_runs_or_says_why_not():
    assert len(snippets()) > 40  # the parser sees the blocks at all
    for snippet in snippets():
        if not snippet.marker:
            continue
        assert snippet.marker.startswith(MARKERS), f"{snippet.where}: {snippet.marker!r}"
        assert snippet.marker.split(":", 1)[-1].strip(), f"{snippet.where}: no reason given"


def test_the_python_blocks_run(tmp_path: Path):
    blocks = runnable("python")
    assert len(blocks) >= 15
    script = ROOT / "tests" / "doc_snippets.py"
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(passed) == len(blocks), result.stdout


@pytest.mark.parametrize(
    "snippet",
    [s for s in snippets() if s.marker.startswith("torchrun ")],
    ids=lambda s: s.where,
)
def test_the_multi_process_python_blocks_run(snippet, tmp_path: Path):
    nproc = snippet.marker.split()[1]
    (tmp_path / "snippet.py").write_text(snippet.body)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc]
    command += ["--standalone", "snippet.py"]
    result = subprocess.run(
        command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("snippet", runnable("bash"), ids=lambda s: s.where)
def test_the_bash_blocks_run(snippet, tmp_path: Path):
    result = subprocess.run(
        ["bash", "-e", "-c", snippet.body], cwd=tmp_path, env=_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("snippet", runnable("toml"), ids=lambda s: s.where)
def test_the_toml_blocks_parse(snippet):
    tomllib.loads(snippet.body)
