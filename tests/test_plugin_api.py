"""The plugin API does not move under its users (issue 50, item 5).

- every ``from mega... import`` / ``import mega...`` in a Python block of README.md and docs/
  runs, and uses no deprecated path: the docs cannot drift from the package;
- a third-party module written against the old paths (before the 2026-11-23 restructuring)
  still loads, with a ``DeprecationWarning`` per old name naming the new path, and gets the same
  objects; ``ParallelSpec``, which has no equivalent, is an ImportError saying what replaced it;
- everything a plugin author needs is importable from ``mega``, and ``import mega`` stays free
  of torch;
- every engine attribute docs/plugins.md promises to plugin hooks exists on a built engine.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import mega

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(?:python|py)[ \t]*\n(.*?)^\1```", re.S | re.M)
# a block that is not valid Python as a whole: its import statements one by one
IMPORT_LINE = re.compile(r"^(?:from mega[\w.]* import (?:\([^)]*\)|.*)|import mega[\w.]*.*)$", re.M)


def is_mega(module: str) -> bool:
    return module == "mega" or module.startswith("mega.")


def documented_imports() -> list[tuple[str, str]]:
    """(``file:line``, statement) for each import of a mega module in a Python block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in FENCE.finditer(text):
            first = text.count("\n", 0, block.start(2)) + 1  # the block's first line
            code = textwrap.dedent(block.group(2))
            try:
                nodes = [
                    (node.lineno, ast.unparse(node))
                    for node in ast.walk(ast.parse(code))
                    if (isinstance(node, ast.ImportFrom) and is_mega(node.module or ""))
                    or (isinstance(node, ast.Import) and any(is_mega(a.name) for a in node.names))
                ]
            except SyntaxError:
                nodes = [
                    (code.count("\n", 0, m.start()) + 1, m.group(0))
                    for m in IMPORT_LINE.finditer(code)
                ]
            where = path.relative_to(ROOT)
            found += [(f"{where}:{first + line - 1}", statement) for line, statement in nodes]
    return found


DOCUMENTED = documented_imports()


def test_the_docs_have_imports_to_check():
    assert len(DOCUMENTED) >= 10
    assert any(where.startswith("docs/plugins.md") for where, _ in DOCUMENTED)


@pytest.mark.parametrize("where, statement", DOCUMENTED, ids=[w for w, _ in DOCUMENTED])
def test_a_documented_import_runs(where: str, statement: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(statement, {})
    deprecated = [str(w.message) for w in caught if "is deprecated since" in str(w.message)]
    assert deprecated == [], f"{where} documents an old path"


# ---------------------------------------------------------------- the old paths

# A plugin written against the documented paths of 2026-11-22 (before the restructuring).
OLD_STYLE_PLUGIN = """
from dataclasses import dataclass

from mega import PipelineScheduleSpec, hookimpl
from mega.core.config import RunConfig
from mega.core.engine import Engine, StepResult
from mega.core.fields import option
from mega.core.init import normal_
from mega.core.linear import Linear
from mega.core.parallel_plan import COLUMN, ParallelPlan
from mega.core.plugins import make_plugins
from mega.core.resolve import resolve_config
from mega.core.topology import Topology
from mega.plugins.parallel.pipeline import schedule_spec, simulate
from mega.plugins.parallel.pipeline.actions import Backward, Forward, with_p2p


@dataclass(kw_only=True)
class OldConfig:
    old_width: int = option(8, "A field made with the old option.")


def table(pp, vpp, m):
    order = [op for mb in range(m) for op in (Forward(mb), Backward(mb))]
    return with_p2p({rank: list(order) for rank in range(pp)}, pp, vpp)


@hookimpl
def register_parallel(register):
    register(PipelineScheduleSpec(name="old-sequential", table=table))
"""

# old module -> (name, its home now) for every name the plugin above imports from an old path
OLD_PATHS = {
    "mega.core.config": {"RunConfig": "mega.core.config.sections"},
    "mega.core.engine": {"Engine": "mega", "StepResult": "mega"},
    "mega.core.fields": {"option": "mega"},
    "mega.core.init": {"normal_": "mega"},
    "mega.core.linear": {"Linear": "mega.parallel.linear"},
    "mega.core.parallel_plan": {"COLUMN": "mega.parallel.plan", "ParallelPlan": "mega"},
    "mega.core.plugins": {"make_plugins": "mega"},
    "mega.core.resolve": {"resolve_config": "mega"},
    "mega.core.topology": {"Topology": "mega.parallel.topology"},
    "mega.plugins.parallel.pipeline": {
        "schedule_spec": "mega.parallel.pipeline",
        "simulate": "mega",
    },
    "mega.plugins.parallel.pipeline.actions": {
        "Backward": "mega",
        "Forward": "mega",
        "with_p2p": "mega",
    },
}


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_plugin_on_the_old_paths_loads_with_deprecation_warnings(tmp_path: Path):
    path = tmp_path / "mega_old_style.py"
    path.write_text(OLD_STYLE_PLUGIN)
    with pytest.warns(DeprecationWarning) as caught:
        old = load_module(path)
    messages = {str(w.message) for w in caught if w.category is DeprecationWarning}
    for module, names in OLD_PATHS.items():
        for name, home in names.items():
            # each old name warns once, at the plugin's import line, naming where it lives now
            expected = f"{module}.{name} is deprecated since 2026-11-23: use "
            expected += f"'from {home} import {name}'"
            assert expected in messages
            assert getattr(old, name) is getattr(importlib.import_module(home), name)
    assert {Path(w.filename) for w in caught if "is deprecated" in str(w.message)} == {path}
    assert len([m for m in messages if "is deprecated" in m]) == sum(map(len, OLD_PATHS.values()))

    # and it works: its schedule registers and its table runs
    plugins = mega.make_plugins(load_entrypoints=False, extra=[("old-style", old)])
    spec = plugins.parallel.get("old-sequential")
    result = mega.simulate(spec.table(2, 1, 4), 2, 1, 4, p2p="rendezvous")
    assert result.bubble_fraction == pytest.approx(0.5)


# moved on 2026-11-27 so that mega.parallel imports nothing from mega.core (issue 50, item 1)
MOVED_BELOW_CORE = {
    "mega.core.errors": ("mega.errors", ["MegaUsageError", "first_line", "unknown_name_message"]),
    "mega.core.training.loss_scaler": ("mega.parallel.loss_scaler", ["DynamicLossScaler"]),
    "mega.core.checkpoint.sharded": ("mega.parallel.sharded", ["Piece", "dtype_name"]),
}


@pytest.mark.parametrize("old", MOVED_BELOW_CORE)
def test_names_moved_below_core_keep_their_old_path_with_a_warning(old: str):
    home, names = MOVED_BELOW_CORE[old]
    module = importlib.import_module(old)
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"{old}.{name} is deprecated since 2026-11-27"):
            value = getattr(module, name)
        assert value is getattr(importlib.import_module(home), name)


def test_parallel_spec_is_gone_with_a_pointer_to_its_replacement():
    with pytest.raises(ImportError, match="PipelineScheduleSpec.*register_parallel"):
        exec("from mega import ParallelSpec", {})


def test_old_packages_still_hand_out_their_submodules_without_a_warning():
    """``mega.core.config`` and ``mega.core.plugins`` are packages now: their shims answer only
    for the old module's names, never for a submodule."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from mega.core.config import resolve, sections
        from mega.core.plugins import manager, specs
    assert sections.RunConfig and resolve.resolve_config and manager.make_plugins and specs
    with pytest.raises(ImportError, match="cannot import name 'nothing_here'"):
        exec("from mega.core.fields import nothing_here", {})


# ---------------------------------------------------------------- the package face

PLUGIN_AUTHOR_NAMES = [
    *("ModelSpec", "TokenizerSpec", "DatasetSpec", "DatasetSplits", "DataRequest"),
    *("PipelineScheduleSpec", "CheckpointBackendSpec", "CheckpointConverterSpec"),
    *("MoEDispatcherSpec", "CPCommTypeSpec", "ParallelPlan", "BuildContext"),
    *("hookimpl", "option", "normal_", "MegaUsageError", "MegaRunError"),
    *("make_plugins", "resolve_config", "Engine", "StepResult"),
    *("ModelWeights", "LazyTensor", "SourceTensors", "ShardedTensor", "Piece"),
    *("Forward", "Backward", "WeightGrad", "SendActivation", "RecvActivation", "SendGrad"),
    *("RecvGrad", "Compute", "Table", "with_p2p", "split_weight_grads", "p2p_batches"),
    *("simulate", "ScheduleError", "SimulationResult"),
]


def test_what_a_plugin_author_needs_is_importable_from_mega():
    assert set(PLUGIN_AUTHOR_NAMES) <= set(mega.__all__)
    for name in mega.__all__:
        assert getattr(mega, name) is not None, name
    assert sorted(dir(mega)) == sorted(mega.__all__)


def test_import_mega_and_the_old_paths_import_no_torch():
    code = (
        "import sys, mega, mega.core.fields, mega.core.engine, mega.plugins.parallel.pipeline;"
        " from mega import with_p2p, simulate, Forward, ModelWeights, ShardedTensor;"
        " print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


# ---------------------------------------------------------------- what hooks may read


def promised_engine_attributes() -> list[str]:
    """The names in docs/plugins.md's sentence 'Attributes you may read: `a`, `b`, ...'."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    sentence = re.search(r"Attributes you may read:(.*?)\.(?:\s|$)", text, re.S)
    assert sentence, "docs/plugins.md no longer lists the engine attributes hooks may read"
    return re.findall(r"`(\w+)`", sentence.group(1))


def test_every_engine_attribute_docs_promise_exists(mega_cli, tiny_gpt, tmp_path):
    names = promised_engine_attributes()
    assert {"config", "model", "padded_vocab", "num_parameters"} <= set(names)
    seen: dict[str, object] = {}

    class Reader:
        @mega.hookimpl
        def step_end(self, engine, iteration, metrics):
            seen.update({name: getattr(engine, name) for name in names})

    args = [*tiny_gpt, "--train-iters", "1", "--run-dir", str(tmp_path / "run")]
    result = mega_cli(["train", *args], Reader())
    assert result.exit_code == 0, result.stderr
    assert set(seen) == set(names)
    # the values are those the run printed at startup
    padded = re.search(r"padded vocab \(size: (\d+)\) .*\(new size: (\d+)\)", result.output)
    assert padded and seen["padded_vocab"] == int(padded.group(2)) > int(padded.group(1))
    counted = re.search(r"model gpt: ([\d,]+) parameters", result.output)
    assert counted and seen["num_parameters"] == int(counted.group(1).replace(",", ""))
    assert seen["iteration"] == 1 and seen["run_dir"] == tmp_path / "run"
