"""A real third-party plugin package, installed with pip and driven through the ``mega`` command.

``tests/plugin_pkgs/mega-plugin-example`` is a separate distribution (its own pyproject, version
0.3.1) that registers the ``bigram`` model, the ``ExampleCharTokenizer`` tokenizer, the
``toy-sequential`` pipeline schedule, the ``example-hello`` command and a ``train_step`` wrapper.
A session fixture installs it into a throw-away virtual environment that sees mega through
``--system-site-packages``; subprocess tests then check discovery, the command, a short training
run, a two-stage pipeline run on the plugin's schedule, and the environment switches that hide
it. The in-process tests at the end use the pattern plugin authors use for unit tests:
``make_plugins(extra=[(name, module)])``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError
from mega.testing.ranks import free_port

from conftest import LAUNCHER_VARS, TINY, lm_losses

PACKAGE_DIR = Path(__file__).parent / "plugin_pkgs" / "mega-plugin-example"
DIST, VERSION, ENTRY_POINT = "mega-plugin-example", "0.3.1", "example"
REGISTERS = {
    "model": ["bigram"],
    "tokenizer": ["ExampleCharTokenizer"],
    "parallel": ["toy-sequential"],
    "command": ["example-hello"],
}
LOSS = re.compile(r"\| lm loss: ([0-9.]+E[+-]\d+) \|")
TRAIN_ARGS = ["--model", "bigram", "--tokenizer-type", "ExampleCharTokenizer", "--eval-iters", "0"]

# What `mega` runs in the venv: what pip writes for a [project.scripts] entry. mega itself lives in
# the parent environment, so pip does not write one into this venv.
LAUNCHER = "#!{python}\nimport sys\n\nfrom mega.cli import main\n\nsys.exit(main())\n"


# --------------------------------------------------------------------------- the installed package


@pytest.fixture(scope="session")
def venv(tmp_path_factory) -> Path:
    """A venv with mega-plugin-example installed; it sees mega, torch, ... from this environment."""
    root = tmp_path_factory.mktemp("third-party-plugin")
    # pip builds in the source tree (build/, *.egg-info): build a copy, not the repository.
    source = root / "src"
    shutil.copytree(
        PACKAGE_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    venv = root / "venv"
    # --without-pip: ensurepip would add its own old setuptools, which cannot build a wheel
    # offline. This environment's pip and setuptools are visible through --system-site-packages.
    _check([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    if sys.prefix != sys.base_prefix:  # pytest runs in a venv: --system-site-packages misses it
        purelib = _check(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
        )
        lines = [f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages()]
        Path(purelib.strip(), "_mega_parent_env.pth").write_text("".join(lines))
    problem = _offline_build_problem()
    if problem:
        pytest.fail(f"cannot build mega-plugin-example offline: {problem}")
    _check(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--disable-pip-version-check", "--quiet", str(source)]
    )
    mega = venv / "bin" / "mega"
    mega.write_text(LAUNCHER.format(python=python))
    mega.chmod(0o755)
    return venv


def _offline_build_problem() -> str | None:
    """Why pip cannot build a wheel here without downloading anything, or None."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return "setuptools is not installed"
    # bdist_wheel moved into setuptools in 70.1; older ones need the separate `wheel` package.
    if tuple(map(int, re.findall(r"\d+", version)[:2])) < (70, 1):
        if importlib.util.find_spec("wheel") is None:
            return f"setuptools {version} needs the `wheel` package (or setuptools >= 70.1)"
    return None


def _clean_env(**env: str) -> dict[str, str]:
    """This process's environment without MEGA_* switches or launcher variables, plus ``env``."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGA_", "SLURM_")) and k not in LAUNCHER_VARS
    }
    environ.update(env)
    return environ


def _check(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=300)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_mega(venv: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``<venv>/bin/mega ARGS`` with no MEGA_* variables from the caller, plus ``env``."""
    cmd = [str(venv / "bin" / "mega"), *args]
    # COLUMNS: wide enough that the rich table does not wrap; one torch thread per process.
    environ = _clean_env(COLUMNS="200", OMP_NUM_THREADS="1", **env)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=environ, timeout=300)


def plugins_json(venv: Path, cwd: Path, **env: str) -> dict:
    done = run_mega(venv, "plugins", "--json", cwd=cwd, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def builtin_models() -> list[str]:
    """mega's own models, whatever other plugins this environment has installed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGA_DISABLE_PLUGIN_AUTOLOAD", "1")
        mp.delenv("MEGA_PLUGINS_DIR", raising=False)
        mp.delenv("MEGA_BLOCK_PLUGINS", raising=False)
        return make_plugins().models.names()


def test_plugins_json_lists_the_package_and_what_it_registers(venv, tmp_path):
    data = plugins_json(venv, tmp_path)
    rows = [row for row in data["plugins"] if row["distribution"] == DIST]
    assert rows == [
        {
            "name": ENTRY_POINT,
            "distribution": DIST,
            "version": VERSION,
            "builtin": False,
            "module": "mega_plugin_example",
            "registers": REGISTERS,
            "hooks": ["shutdown", "train_step"],  # its lifecycle and step hooks
            "error": None,
        }
    ]
    assert data["problems"] == []
    assert any(
        row["builtin"] and row["registers"].get("model") == ["gpt"] for row in data["plugins"]
    )


def test_plugins_table_shows_distribution_and_version(venv, tmp_path):
    done = run_mega(venv, "plugins", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if DIST in line)
    assert ENTRY_POINT in row and VERSION in row and "model: bigram" in row


def test_plugin_import_stays_cheap(venv):
    # Discovery imports every plugin on every command and rank: no torch or numpy at import time.
    code = (
        "import sys; from mega.core.plugins.manager import make_plugins; p = make_plugins();"
        "print('bigram' in p.models, sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    assert _check([str(venv / "bin" / "python"), "-c", code]).strip() == "True []"


def test_example_hello_command(venv, tmp_path, builtin_models):
    done = run_mega(venv, "example-hello", "--name", "Ada", cwd=tmp_path, MEGA_PLUGINS=DIST)
    assert done.returncode == 0, done.stderr
    models = sorted([*builtin_models, "bigram"])
    assert done.stdout == f"Hello, Ada! mega knows {len(models)} models: {', '.join(models)}\n"
    listing = run_mega(venv, "--help", cwd=tmp_path)
    assert re.search(r"^\s+example-hello\s+Greet NAME", listing.stdout, re.M), listing.stdout


def test_the_example_package_tests_itself_with_mega_testing(venv, tmp_path):
    """The package's own tests use mega's pytest plugin (``mega_plugins``, ``mega_cli``) with no
    conftest: pytest in the plugin's environment finds the fixtures through mega's entry point."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["--rootdir", str(tmp_path), str(PACKAGE_DIR / "tests")],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout


def test_training_a_plugin_model_with_a_plugin_tokenizer(venv, tmp_path):
    run_dir = tmp_path / "run"
    args = [*TRAIN_ARGS, "--train-iters", "12", "--log-interval", "1", "--lr", "0.05"]
    done = run_mega(
        venv, "train", *args, "--hidden-size", "16", "--run-dir", str(run_dir), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # 74 ids (71 characters + unk, eod, pad) padded to a multiple of 128.
    assert "padded vocab (size: 74) with 54 dummy tokens (new size: 128)" in out
    assert "model bigram: 4,224 parameters" in out  # E [128,16] + W [128,16] + bias [128]
    assert "tokenizer ExampleCharTokenizer" in out
    losses = [float(x) for x in LOSS.findall(out)]
    assert len(losses) == 12, out
    # Initial logits are ~0 (std 0.02, rank 16): uniform over the padded vocab.
    assert losses[0] == pytest.approx(math.log(128), abs=0.02)
    assert losses[-1] < losses[0] - 1.0, losses
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    # The run records the plugin's version and its config section, like any built-in's.
    assert (
        f"{DIST}=={VERSION}  # {ENTRY_POINT}: model: bigram"
        in (run_dir / "plugins.txt").read_text()
    )
    resolved = (run_dir / "config.resolved.toml").read_text()
    assert '[model]\nname = "bigram"\nhidden_size = 16\n' in resolved
    assert "[tokenizer]\nlowercase = true\n" in resolved
    # The train_step wrapper saw every step, and the shutdown hook saw the run succeed.
    steps = json.loads((run_dir / "example-steps.json").read_text())
    assert steps["steps"] == 12 and steps["ok"] is True and steps["mean_step_ms"] > 0


def test_plugins_table_lists_the_schedule(venv, tmp_path):
    done = run_mega(venv, "plugins", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"│\s+│\s+│\s+│ parallel: toy-sequential\s+│", done.stdout), done.stdout


def test_schedule_command_simulates_the_plugin_schedule(venv, tmp_path):
    args = ["--schedule", "toy-sequential", "--pp", "2", "-m", "4", "--width", "60"]
    done = run_mega(venv, "schedule", *args, "--p2p", "rendezvous", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("toy-sequential: 2 pipeline ranks x 1 chunk, 4 micro-batches;"), out
    assert "checked: finishes with rendezvous p2p" in out
    # One rank works at a time: each micro-batch takes 4 units (F F B B), each rank is busy 2.
    assert "bubble: 0.5000 simulated (time 16 per rank, 8 busy on average)" in out, out
    assert re.search(r"; analytic .*\b0\.5000$", out.rstrip()), out  # the spec's (p-1)/p


# Dropout off and no linear biases, as in test_launch.py: a pipelined run must print the losses of
# one process exactly (up to float32 summation order).
PIPELINE_ARGS = [
    *TINY, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear", "--mock-data",
]  # fmt: skip


def test_training_on_the_plugin_schedule_matches_one_process(venv, tmp_path):
    """Two pipeline stages of the tiny GPT (one layer each, tied embeddings) on the plugin's
    schedule: 4 micro-batches per step, the one-process run's losses."""
    layout = ["--parallel", "toy-sequential", "--pipeline-model-parallel-size", "2"]
    layout += ["--nproc-per-node", "2", "--master-port", str(free_port())]
    runs = {}
    for name, extra in (("one", []), ("pp2", layout)):
        cwd = tmp_path / name
        cwd.mkdir()
        runs[name] = run_mega(venv, "train", *PIPELINE_ARGS, *extra, cwd=cwd)
        assert runs[name].returncode == 0, runs[name].stderr
    assert "pp 2 x" in runs["pp2"].stdout and "schedule toy-sequential" in runs["pp2"].stdout
    one, pp2 = lm_losses(runs["one"].stdout), lm_losses(runs["pp2"].stdout)
    assert sorted(one) == sorted(pp2) == [1, 2, 3, 4], (runs["one"].stdout, runs["pp2"].stdout)
    for iteration in one:
        assert float(pp2[iteration]) == pytest.approx(float(one[iteration]), rel=1e-5), iteration


def test_train_help_shows_the_plugin_flags(venv, tmp_path):
    done = run_mega(venv, "train", *TRAIN_ARGS, "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"available: [^)]*\bbigram\b", done.stdout)
    assert re.search(r"^  --hidden-size VALUE\s+Width of the token embedding", done.stdout, re.M)
    assert re.search(r"^  --lowercase, --no-lowercase\s+Lower-case text", done.stdout, re.M)


ALLOWED = [{}, {"MEGA_PLUGINS": DIST}, {"MEGA_PLUGINS": f"other,{ENTRY_POINT}"}]
HIDDEN = [
    {"MEGA_PLUGINS": ""},
    {"MEGA_PLUGINS": "some-other-plugin"},
    {"MEGA_DISABLE_PLUGIN_AUTOLOAD": "1"},
    {"MEGA_BLOCK_PLUGINS": ENTRY_POINT},
]


@pytest.mark.parametrize(
    "env", ALLOWED, ids=lambda env: ",".join(map("=".join, env.items())) or "default"
)
def test_allowlist_keeps_the_plugin(venv, tmp_path, env):
    names = {row["name"] for row in plugins_json(venv, tmp_path, **env)["plugins"]}
    assert ENTRY_POINT in names


@pytest.mark.parametrize("env", HIDDEN, ids=lambda env: ",".join(map("=".join, env.items())))
def test_switches_hide_the_plugin_but_keep_builtins(venv, tmp_path, env, builtin_models):
    rows = plugins_json(venv, tmp_path, **env)["plugins"]
    assert all(row["distribution"] != DIST for row in rows)
    assert all(row["builtin"] and row["error"] is None for row in rows)
    assert sorted(m for row in rows for m in row["registers"].get("model", [])) == builtin_models

    done = run_mega(venv, "train", *TRAIN_ARGS, "--train-iters", "2", cwd=tmp_path, **env)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"error: unknown model 'bigram' (available: {', '.join(builtin_models)})\n"
    ), done.stderr
    done = run_mega(venv, "example-hello", cwd=tmp_path, **env)
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown command 'example-hello' (available: ")
    assert len(done.stderr.splitlines()) == 1


# --------------------------------------------------------------------------- in process


@pytest.fixture
def example(monkeypatch):
    """The plugin module imported from its source tree, as a plugin author's own tests would."""
    monkeypatch.syspath_prepend(str(PACKAGE_DIR))
    monkeypatch.setenv("MEGA_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins only, plus `extra`
    import mega_plugin_example

    return mega_plugin_example


def test_in_process_registration(example):
    alone = make_plugins(load_entrypoints=False, extra=[("example", example)])
    assert (alone.models.names(), alone.tokenizers.names()) == (
        ["bigram"],
        ["ExampleCharTokenizer"],
    )
    assert alone.commands.names() == ["example-hello"]
    assert alone.parallel.names() == ["toy-sequential"]
    assert alone.infos[0].registers == REGISTERS and alone.infos[0].dist == "(in process)"

    plugins = make_plugins(extra=[("example", example)])  # with the built-ins
    assert {"bigram", "gpt"} <= set(plugins.models)
    assert plugins.models.provider("bigram") == "example"
    assert plugins.parallel.provider("toy-sequential") == "example"
    assert plugins.problems == []


@pytest.mark.parametrize("p2p", ["eager", "rendezvous"])
def test_toy_schedule_runs_and_its_bubble_is_analytic(example, p2p):
    from mega.parallel.pipeline import schedule_spec, simulate, table_problems
    from mega.parallel.pipeline.actions import Backward, Forward

    plugins = make_plugins(extra=[("example", example)])
    spec = schedule_spec(plugins, "toy-sequential")
    gpipe, one_f_one_b = schedule_spec(plugins, "gpipe"), schedule_spec(plugins, "1f1b")
    for pp in range(1, 5):
        for m in (1, 2, 3, 4, 7, 8):
            assert table_problems(spec, pp, 1, m, num_layers=4 * pp) == []
            table = spec.table(pp, 1, m)
            result = simulate(table, pp, 1, m, p2p=p2p)  # raises ScheduleError if it cannot run
            assert result.bubble_fraction == pytest.approx(spec.analytic_bubble(pp, 1, m))
            slow = simulate(table, pp, 1, m, forward_cost=1, backward_cost=2, p2p=p2p)
            assert slow.bubble_fraction == pytest.approx((pp - 1) / pp)
            # Every rank computes F0 B0 F1 B1 ...: not a built-in table once there is overlap to lose.
            computes = [a for a in table[pp - 1] if isinstance(a, Forward | Backward)]
            assert computes == [op for mb in range(m) for op in (Forward(mb), Backward(mb))]
            if pp > 1 and m > 1:
                assert table not in (gpipe.table(pp, 1, m), one_f_one_b.table(pp, 1, m))
    assert table_problems(spec, 2, 2, 4) != []  # one chunk per rank only


def test_plugin_flags_resolve_into_its_config_sections(example):
    plugins = make_plugins(extra=[("example", example)])
    argv = [*TRAIN_ARGS, "--hidden-size", "8", "--no-output-bias", "--no-lowercase"]
    config = resolve_config(argv, plugins)
    assert config.model_name == "bigram" and config.tokenizer_name == "ExampleCharTokenizer"
    assert config.model == example.BigramConfig(hidden_size=8, output_bias=False)
    assert config.tokenizer.lowercase is False

    with pytest.raises(MegaUsageError) as info:
        resolve_config([*TRAIN_ARGS, "--hidden-size", "0", "--init-method-std", "-1"], plugins)
    assert info.value.messages == [
        "--hidden-size (0) must be positive",
        "--init-method-std (-1.0) must not be negative",
    ]


def test_char_tokenizer(example):
    from mega_plugin_example.tokenizer import ALPHABET, ExampleCharTokenizerConfig

    plugins = make_plugins(load_entrypoints=False, extra=[("example", example)])
    tok = plugins.tokenizers.get("ExampleCharTokenizer").build(ExampleCharTokenizerConfig())
    assert (len(ALPHABET), tok.unk, tok.eod, tok.pad, tok.vocab_size) == (71, 71, 72, 73, 74)
    assert tok.eos == tok.eod != tok.pad
    assert tok.bos is None and tok.cls is None and tok.sep is None and tok.mask is None
    text = "hello, world!\n\tx = [1, 2] # ok?"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize("Hi") == tok.tokenize("hi") == [7, 8]
    assert tok.detokenize(tok.tokenize("Café") + [tok.eod, tok.pad]) == "caf\ufffd"
    strict = example.ExampleCharTokenizer(lowercase=False)
    assert strict.tokenize("Hi") == [tok.unk, 8]
    assert strict.unique_identifiers != tok.unique_identifiers


def test_bigram_model_contract(example):
    import torch
    import torch.nn.functional as F

    from mega import BuildContext

    spec = make_plugins(load_entrypoints=False, extra=[("example", example)]).models.get("bigram")
    cfg = example.BigramConfig(hidden_size=8)

    def build(seed: int):
        ctx = BuildContext(
            seed=seed, device="cpu", params_dtype="float32", seq_length=16, padded_vocab_size=128
        )
        return spec.build(cfg, ctx)

    model = build(seed=7)
    assert sum(p.numel() for p in model.parameters()) == 128 * 8 * 2 + 128
    tokens = torch.randint(0, 74, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, dims=1)
    logits = model(tokens)
    assert logits.shape == (2, 16, 128)
    loss = model(tokens, labels=labels)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(loss, expected.view(2, 16))
    assert loss.mean().item() == pytest.approx(math.log(128), abs=0.01)
    # Initialisation depends on the seed only (mega.core.training.init.normal_ per parameter name).
    same, other = build(seed=7).state_dict(), build(seed=8).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(same[name], value, rtol=0, atol=0)
    assert not torch.equal(other["embedding.weight"], model.state_dict()["embedding.weight"])
    # The loss stays float32 when the engine casts the parameters to bf16.
    assert model.to(torch.bfloat16)(tokens, labels=labels).dtype == torch.float32
    assert spec.flops_per_token(cfg, 16, 128) == 6 * 8 * 128
