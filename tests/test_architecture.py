"""The package's shape, read from its source with ast (nothing is imported, no torch):
``mega.core`` imports no plugin and no CLI module, only the entry point (and ``mega.testing``,
which runs commands as a user would) imports the CLI, no model plugin imports another (what they
share is ``mega.plugins.models.common``), and no
module imports itself back through others (no cycles, counting imports inside functions too)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mega"


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_edges() -> dict[str, set[str]]:
    """Module -> the mega modules it imports, at any depth of the file. ``from a import b``
    counts ``a.b`` if that is a module (a child importing a sibling through their package), else
    ``a``."""
    modules = module_files()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    child = f"{base}.{alias.name}"
                    targets.add(child if child in modules else base)
        edges[module] = {t for t in map(owner, targets) if t and t != module}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def arrows(wrong: Callable[[str, str], bool]) -> list[str]:
    """Every import ``a -> b`` of the package for which ``wrong(a, b)`` holds, sorted."""
    edges = import_edges()
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if wrong(a, b))


def test_core_imports_no_plugin_or_cli():
    assert arrows(lambda a, b: layer(a) == "core" and layer(b) in ("plugins", "cli")) == []


def test_parallel_is_the_ground_floor():
    # mega.parallel (collectives, parallel layers, schedules, the distributed optimizer) is what
    # core's training builds on: it imports nothing from core, the plugins or the CLI. What both
    # need lives in parallel or beside the package face (mega.errors).
    above = ("core", "plugins", "cli")
    assert arrows(lambda a, b: layer(a) == "parallel" and layer(b) in above) == []


# mega.core's rooms, bottom first: each imports only rooms below it (and modules outside core).
# The schedules are pure arithmetic over the config's values; the plugin machinery knows the
# specs; the checkpoint storage knows files, and checkpoint conversion other tools' files; the
# config validates against plugins and storage; the console prints runs; training builds and
# runs them; the planner shadows a training build.
CORE_ROOMS = (
    "schedules", "plugins", "checkpoint", "convert", "config", "console", "training", "plan",
)  # fmt: skip


def core_room(module: str) -> str | None:
    """The room (sub-package) of ``mega.core`` a module lives in; None outside them (the
    package's own modules, which are deprecated aliases, and everything outside core)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["mega", "core"] and len(parts) > 3 else None


def test_core_rooms_form_a_stack():
    rooms = {path.name for path in (PACKAGE / "core").iterdir() if (path / "__init__.py").exists()}
    assert rooms == set(CORE_ROOMS), "a new room of mega.core takes its place in CORE_ROOMS"
    level = {room: index for index, room in enumerate(CORE_ROOMS)}

    def upward(a: str, b: str) -> bool:
        ra, rb = core_room(a), core_room(b)
        return ra is not None and rb is not None and level[rb] > level[ra]

    assert arrows(upward) == []


def test_the_package_face_is_imported_only_from_above_it():
    # mega/__init__.py re-exports core's and parallel's names for plugin authors; core and
    # parallel import the defining modules, never the face (an arrow back up)
    assert arrows(lambda a, b: layer(a) in ("core", "parallel") and b == "mega") == []


def test_only_the_entry_point_imports_the_cli():
    # mega.testing runs commands as a user would (in-process, through click)
    allowed = ("cli", "testing")
    assert (
        arrows(lambda a, b: layer(b) == "cli" and layer(a) not in allowed and a != "mega.__main__")
        == []
    )


def test_the_training_loop_stays_small():
    # the engine owns the loop and the process topology; what grows (FP8 scaling, async saves,
    # router statistics, the plan check) belongs in the parts it calls or in plugins
    lines = (PACKAGE / "core" / "training" / "engine.py").read_text().count("\n")
    assert lines <= 300, f"engine.py has {lines} lines"


MODELS = "mega.plugins.models."
SHARED = "common"  # the parts the model families share: not a family


def model_family(module: str) -> str | None:
    """``gpt`` for ``mega.plugins.models.gpt.plan``; None outside the model plugins."""
    return module[len(MODELS) :].split(".")[0] if module.startswith(MODELS) else None


def test_no_model_plugin_imports_another():
    # each model family imports only mega.plugins.models.common for what it shares with the
    # others (the layers, attention, norms, init, plan pieces, config base), and common imports
    # no family: a model plugin can be read, changed or copied out on its own
    def crosses(a: str, b: str) -> bool:
        source, target = model_family(a), model_family(b)
        if source is None or target is None or target == SHARED:
            return False
        return source == SHARED or source != target

    assert arrows(crosses) == []


def test_no_import_cycles():
    assert cycles(import_edges()) == []


def test_the_checks_see_a_wrong_arrow(tmp_path, monkeypatch):
    """The walker finds arrows and cycles at all: on a toy package with both."""
    toy = tmp_path / "mega"
    (toy / "core").mkdir(parents=True)
    (toy / "plugins").mkdir()
    for init in (toy, toy / "core", toy / "plugins"):
        (init / "__init__.py").write_text("")
    (toy / "core" / "a.py").write_text("def f():\n    from mega.plugins import b\n")
    (toy / "plugins" / "b.py").write_text("from mega.core.a import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", toy)
    edges = import_edges()
    assert edges["mega.core.a"] == {"mega.plugins.b"}  # the module, not its package
    assert cycles(edges) == [["mega.core.a", "mega.plugins.b"]]


def test_the_training_loop_does_not_import_the_planner():
    # the plan check is a built-in plugin on the lifecycle hooks (mega.plugins.lifecycle)
    planner = [
        b for b in import_edges()["mega.core.training.engine"] if b.startswith("mega.core.plan")
    ]
    assert planner == []


LIFECYCLE_HOOKS = ("topology_ready", "step_end", "checkpoint_saved", "shutdown")


def test_every_lifecycle_hook_has_a_builtin_implementation(monkeypatch):
    """mega's own features use the hooks it offers plugins (the metrics sinks, the plan check,
    the "saved checkpoint" line), so every run exercises them. The one test here that imports
    mega: it counts, hook by hook, the implementations of the built-in plugins alone."""
    from mega.core.plugins.manager import make_plugins

    monkeypatch.setenv("MEGA_DISABLE_PLUGIN_AUTOLOAD", "1")  # no third-party plugin
    monkeypatch.delenv("MEGA_PLUGINS_DIR", raising=False)
    monkeypatch.delenv("MEGA_BLOCK_PLUGINS", raising=False)
    plugins = make_plugins()
    builtin = {info.name for info in plugins.infos if info.builtin and info.error is None}
    assert builtin == {info.name for info in plugins.infos}
    counts = {
        hook: sum(
            impl.plugin_name in builtin for impl in getattr(plugins.pm.hook, hook).get_hookimpls()
        )
        for hook in LIFECYCLE_HOOKS
    }
    assert all(count > 0 for count in counts.values()), counts
