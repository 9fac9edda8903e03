"""``mega plot`` (runs' curves from metrics.jsonl, PNG or SVG) and ``mega plugins`` in a pipe."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from conftest import TINY, mega_in_fork, run_mega

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (mega[plot])"
)
RUN = [*TINY, "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1"]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@needs_matplotlib
def test_plot_draws_several_runs_on_the_same_axes(tmp_path: Path):
    # mega's commands in one fork of this process (conftest.mega_in_fork), not five interpreters
    *trained, svg, png = mega_in_fork(
        [
            ["train", *RUN, "--lr", "1e-3", "--run-dir", "tp1"],
            ["train", *RUN, "--lr", "3e-3", "--run-dir", "tp2-resumed"],
            ["plot", "tp1", "tp2-resumed", "--output", "cmp.svg"],
            ["plot", "tp1", "--output", "one.png", "--metrics", "loss,lr"],
        ],
        tmp_path,
    )
    for result in trained:
        assert result.exit_code == 0, result.stderr
    assert svg.exit_code == 0, svg.stderr
    assert svg.output.strip() == "wrote cmp.svg: loss, lr, grad_norm, tokens_per_s of 2 run(s)"
    text = (tmp_path / "cmp.svg").read_text()
    for label in ["tp1", "tp2-resumed", "tp1 (validation)", "tp2-resumed (validation)",
                  "lm loss", "learning rate", "grad norm", "tokens per second", "iteration"]:  # fmt: skip
        assert f">{label}<" in text, label
    # one line per run and panel, and the validation points (iterations 3 and 6) of each run
    for run in ("run0", "run1"):
        for panel in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert f'<g id="{run}-{panel}">' in text, (run, panel)
        assert f'<g id="{run}-loss-validation">' in text

    assert png.exit_code == 0, png.stderr
    width, height = png_size(tmp_path / "one.png")
    assert 600 <= width <= 1500 and 300 <= height <= 900, (width, height)
    assert (tmp_path / "one.png").stat().st_size > 10_000  # drawn curves, not an empty frame
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["cmp.svg", "one.png"]


@needs_matplotlib
def test_plot_shows_a_resumed_run_once_per_iteration(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        *({"iteration": i, "lm_loss": 5.0 - 0.1 * i, "learning_rate": 1e-3} for i in range(1, 7)),
        {"event": "resume", "iteration": 4, "load": "run"},
        *({"iteration": i, "lm_loss": 9.0, "learning_rate": 1e-3} for i in range(5, 9)),
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_mega(["plot", "run", "-o", "r.svg", "--metrics", "loss"], tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "r.svg").read_text()
    # the loss line has one vertex per iteration 1..8: 'M' then 7 'L's, x never going back
    line = text.split('<g id="run0-loss">', 1)[1]
    path = line.split(' d="', 1)[1].split('"', 1)[0]
    xs = [float(v.split()[0]) for v in path.replace("M", "L").split("L") if v.strip()]
    assert len(xs) == 8 and xs == sorted(xs), path
    assert '<g id="run0-loss-resume">' in text  # the restart is marked


def test_plot_errors_are_one_line_each(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    result = run_mega(
        ["plot", "missing", "empty", "--metrics", "loss,lrr", "-o", "x.gif"], tmp_path
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --metrics: unknown metric 'lrr' (available: grad_norm, loss, lr, tokens_per_s;"
        " did you mean 'lr'?)",
        "error: --output x.gif: cannot write .gif files (use .png, .svg, .pdf)",
        "error: missing: no such directory (give a run directory of `mega train`)",
        "error: empty: no metrics.jsonl in it (give a run directory of `mega train`)",
    ]


def test_plot_without_matplotlib_is_one_line(tmp_path: Path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('blocked for a test')\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1, "lm_loss": 5.0}\n')
    result = run_mega(["plot", "run"], tmp_path, env={"PYTHONPATH": str(blocker)})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: mega plot needs matplotlib: pip install 'mega[plot]' (or pip install matplotlib)"
    )


LONG_PLUGIN = """
from dataclasses import dataclass
from mega import TokenizerSpec, hookimpl

@dataclass(kw_only=True)
class NoConfig:
    pass

@hookimpl
def register_tokenizers(register):
    register(TokenizerSpec(name="AVeryLongTokenizerNameThatMustStayWholeInAPipe", config_cls=NoConfig,
                           build=lambda config: None))
"""


def test_plugins_table_keeps_names_whole_when_not_on_a_terminal(tmp_path: Path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    name = "a_plugin_module_with_a_long_descriptive_name"
    (plugins / f"{name}.py").write_text(LONG_PLUGIN)
    env = {"MEGA_PLUGINS_DIR": str(plugins), "COLUMNS": "80"}
    result = run_mega(["plugins"], tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert name in result.stdout
    assert "tokenizer: AVeryLongTokenizerNameThatMustStayWholeInAPipe" in result.stdout
    assert "sentencepiece_tokenizers" in result.stdout and "\u2026" not in result.stdout
