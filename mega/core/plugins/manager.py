"""Discover plugins through the ``mega`` entry-point group and fill the registries.

Built-in plugins come through the same group (mega's own pyproject lists them), so there is one
discovery path. Environment switches, applied to third-party plugins only:

- ``MEGA_DISABLE_PLUGIN_AUTOLOAD=1``: load no third-party entry points.
- ``MEGA_PLUGINS=dist-a,dist-b``: load only these third-party distributions (empty: none).
- ``MEGA_BLOCK_PLUGINS=name,...``: block plugins by entry-point name (built-ins included).
- ``MEGA_PLUGINS_DIR=DIR``: also load every ``*.py`` file in DIR as a plugin.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from mega.core.plugins import hookspecs
from mega.core.plugins.registry import (
    BUILTIN_CHOICE_KINDS,
    CHOICES_HOOK,
    DEPRECATED_CHOICE_HOOKS,
    REGISTRY_HOOKS,
    DuplicateNameError,
    Registry,
)
from mega.errors import MegaUsageError, unknown_name_message

GROUP = "mega"
BUILTIN_DIST = "mega"


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin, as ``mega plugins`` shows it."""

    name: str
    dist: str
    version: str
    builtin: bool
    module: str
    error: str | None = None
    registers: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Plugins:
    """The plugin manager plus the registries its plugins filled. Build one per command."""

    pm: pluggy.PluginManager
    infos: list[PluginInfo]
    registries: dict[str, Registry[Any]]
    problems: list[str]  # duplicate names: fatal for commands that use the registries

    def failures(self) -> list[PluginInfo]:
        """Plugins that failed to import or to register (shown as warnings, never fatal)."""
        return [info for info in self.infos if info.error]

    @property
    def models(self) -> Registry[Any]:
        return self.registries["model"]

    @property
    def tokenizers(self) -> Registry[Any]:
        return self.registries["tokenizer"]

    @property
    def datasets(self) -> Registry[Any]:
        return self.registries["dataset"]

    @property
    def parallel(self) -> Registry[Any]:
        """The pipeline schedules (``--parallel``)."""
        return self.choices("parallel")

    @property
    def checkpoint_backends(self) -> Registry[Any]:
        return self.registries["checkpoint backend"]

    @property
    def checkpoint_converters(self) -> Registry[Any]:
        return self.registries["checkpoint converter"]

    @property
    def moe_dispatchers(self) -> Registry[Any]:
        return self.choices("moe dispatcher")

    @property
    def cp_comm_types(self) -> Registry[Any]:
        return self.choices("cp comm type")

    def choices(self, kind: str) -> Registry[Any]:
        """The parallel choices of ``kind`` (a spec class's ``choice_kind``) that plugins
        registered through ``register_parallel_choices``; empty when none did."""
        return self.registries.get(kind) or Registry(kind)

    @property
    def optimizers(self) -> Registry[Any]:
        return self.registries["optimizer"]

    @property
    def commands(self) -> Registry[Any]:
        return self.registries["command"]

    def check(self, kinds: list[str] | None = None) -> None:
        """Raise the collected duplicate-name errors of the registries ``kinds`` (default: all),
        all together. Commands need not call it: ``Registry.get`` refuses a clashing name."""
        kinds = list(self.registries) if kinds is None else kinds
        clashes = [m for kind in kinds for m in self.registries[kind].clashes.values()]
        if clashes:
            raise MegaUsageError(clashes)


def _split_env(name: str) -> list[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


class _DistNames:
    """The name and version of each entry point's distribution, its metadata read once per
    distribution: ``ep.dist.name`` and ``.version`` parse the METADATA file on every access
    (about 0.3 s per ``make_plugins`` for mega's 36 built-in entry points, paid by every
    process that starts, every rank of a launch included). An entry point without a
    distribution is ``"?"``."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[str, str]] = {}

    def _of(self, ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
        dist = ep.dist
        if dist is None:
            return "?", "?"
        if id(dist) not in self._seen:  # one Distribution object is shared by its entry points
            metadata = dist.metadata
            self._seen[id(dist)] = (metadata["Name"], metadata["Version"])
        return self._seen[id(dist)]

    def name(self, ep: importlib.metadata.EntryPoint) -> str:
        return self._of(ep)[0]

    def version(self, ep: importlib.metadata.EntryPoint) -> str:
        return self._of(ep)[1]


def _wanted(ep: importlib.metadata.EntryPoint, builtin: bool, dist: str) -> bool:
    if builtin:
        return True
    if os.environ.get("MEGA_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
        return False
    allow = _split_env("MEGA_PLUGINS")
    return allow is None or dist in allow or ep.name in allow


def _load_dir(directory: Path, blocked: set[str]) -> list[tuple[str, Any, str | None]]:
    """Loose ``*.py`` plugin files, blocked ones skipped: (name, module or None, error)."""
    loaded = []
    for path in sorted(directory.glob("*.py")):
        if path.stem in blocked:
            continue
        name = f"mega_plugins_dir.{path.stem}"
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            loaded.append((path.stem, module, None))
        except Exception as exc:  # a broken plugin is reported, not fatal
            loaded.append((path.stem, None, f"{type(exc).__name__}: {exc}"))
    return loaded


def make_plugins(*, load_entrypoints: bool = True, extra: list[tuple[str, Any]] = ()) -> Plugins:
    """Build a plugin manager, load plugins, and fill the registries.

    :param load_entrypoints: load the ``mega`` entry-point group (built-ins included). Tests pass
        False plus ``extra`` to build a manager from explicit plugin objects.
    :param extra: ``(name, plugin)`` pairs registered after the entry points.
    """
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    blocked = set(_split_env("MEGA_BLOCK_PLUGINS") or [])
    infos: list[PluginInfo] = []

    if load_entrypoints:
        eps = sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name)
        dists = _DistNames()
        if not any(dists.name(ep) == BUILTIN_DIST for ep in eps):
            raise MegaUsageError(
                "mega's built-in plugins are not installed: run `pip install -e .` in the checkout"
            )
        for ep in eps:
            dist = dists.name(ep)
            builtin = dist == BUILTIN_DIST
            if ep.name in blocked or not _wanted(ep, builtin, dist):
                continue
            info = PluginInfo(ep.name, dist, dists.version(ep), builtin, ep.value)
            infos.append(info)
            try:
                plugin = ep.load()
            except Exception as exc:  # reported by `mega plugins`, other plugins still load
                info.error = f"{type(exc).__name__}: {exc}"
                continue
            _register(pm, plugin, info)

    plugins_dir = os.environ.get("MEGA_PLUGINS_DIR")
    if plugins_dir:
        for name, module, error in _load_dir(Path(plugins_dir), blocked):
            info = PluginInfo(name, f"file:{plugins_dir}", "-", False, f"{name}.py", error)
            infos.append(info)
            if module is not None:
                _register(pm, module, info)

    for name, plugin in extra:
        info = PluginInfo(name, "(in process)", "-", False, getattr(plugin, "__name__", name))
        infos.append(info)
        _register(pm, plugin, info)

    pm.check_pending()
    registries, problems = _fill_registries(pm, {i.name: i for i in infos if i.error is None})
    return Plugins(pm=pm, infos=infos, registries=registries, problems=problems)


def _register(pm: pluggy.PluginManager, plugin: Any, info: PluginInfo) -> None:
    """Register ``plugin``; one that pluggy rejects, or that implements a hook mega does not
    have (a typo such as ``register_model``), is unregistered and reported instead."""
    try:
        pm.register(plugin, name=info.name)
    except Exception as exc:  # a hookimpl whose arguments do not match its hookspec
        info.error = f"{type(exc).__name__}: {exc}"
        return
    unknown = [
        name
        for name, caller in vars(pm.hook).items()
        if not caller.has_spec() and any(i.plugin is plugin for i in caller.get_hookimpls())
    ]
    if unknown:
        pm.unregister(plugin)
        known = [name for name, caller in vars(pm.hook).items() if caller.has_spec()]
        info.error = "; ".join(unknown_name_message("hook", name, known) for name in unknown)


def _registration_hooks() -> list[tuple[str, str | None]]:
    """(hook, the registry kind it fills, or None where each spec names its own), in the order
    providers are first seen (a clash keeps the first)."""
    fixed = [(hook, kind) for kind, hook in REGISTRY_HOOKS.items()]
    return [*fixed, (CHOICES_HOOK, None), *DEPRECATED_CHOICE_HOOKS.items()]


def _fill_registries(
    pm: pluggy.PluginManager, infos: dict[str, PluginInfo]
) -> tuple[dict[str, Registry[Any]], list[str]]:
    """Call each ``register_*`` hook plugin by plugin, so every spec knows who provided it.

    Two phases: every hook's registrations are collected first, and only plugins whose hooks
    all returned fill the registries. A plugin whose ``register_*`` hook raises is unregistered
    from the plugin manager and leaves nothing behind: not what it registered before raising,
    not its other hooks (``validate_config``, ``step_end``, ...), not a name clash it caused."""
    collected: list[tuple[str, str, Any]] = []  # (kind, provider, spec), in hook order
    failed: set[str] = set()
    for hook_name, kind in _registration_hooks():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            provider = impl.plugin_name
            if hook_name in DEPRECATED_CHOICE_HOOKS:
                _warn_deprecated_hook(hook_name, impl.function)
            specs: list[Any] = []
            try:
                impl.function(register=_collector(specs, kind, provider))
            except Exception as exc:  # reported like an import failure, not fatal to the rest
                failed.add(provider)
                info = infos.get(provider)
                if info is not None and info.error is None:
                    info.error = f"{hook_name}: {type(exc).__name__}: {exc}"
                continue
            collected += [(kind or spec.choice_kind, provider, spec) for spec in specs]
    for provider in failed:
        plugin = pm.get_plugin(provider)
        if plugin is not None:
            pm.unregister(plugin)
        if provider in infos:
            infos[provider].registers.clear()
    kinds = (*REGISTRY_HOOKS, *BUILTIN_CHOICE_KINDS)
    registries: dict[str, Registry[Any]] = {kind: Registry(kind) for kind in kinds}
    problems: list[str] = []
    for kind, provider, spec in collected:
        if provider not in failed:
            registry = registries.setdefault(kind, Registry(kind))  # a plugin's new kind
            _callback(registry, kind, provider, infos.get(provider), problems)(spec)
    return registries, problems


def _warn_deprecated_hook(hook_name: str, function: Any) -> None:
    """A ``DeprecationWarning`` pointing at the plugin's implementation of an old hook."""
    code = getattr(function, "__code__", None)
    warnings.warn_explicit(
        f"the {hook_name} hook is deprecated since 2026-11-28: implement "
        f"{CHOICES_HOOK} (the spec's class says which choice it is)",
        DeprecationWarning,
        filename=code.co_filename if code else "<plugin>",
        lineno=code.co_firstlineno if code else 0,
        module=getattr(function, "__module__", None),
    )


def _collector(specs: list[Any], kind: str | None, provider: str):
    """The ``register`` a plugin's hook receives: it keeps each spec for the second phase.
    ``kind`` None: a parallel choice, whose class names its kind."""

    def register(spec: Any) -> None:
        what = kind or "parallel choice"
        name = getattr(spec, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{provider} registered a {what} without a name: {spec!r}")
        if kind is None and not isinstance(getattr(spec, "choice_kind", None), str):
            raise TypeError(
                f"{provider} registered {spec!r} as a parallel choice, but its class has no "
                "choice_kind (PipelineScheduleSpec, MoEDispatcherSpec and CPCommTypeSpec have "
                "one; a new kind of choice declares its own)"
            )
        if kind is None and spec.choice_kind in REGISTRY_HOOKS:  # e.g. "model": not a choice
            hook = REGISTRY_HOOKS[spec.choice_kind]
            raise TypeError(
                f"{provider} registered a {spec.choice_kind} as a parallel choice: {hook}"
            )
        specs.append(spec)

    return register


def _callback(
    registry: Registry[Any], kind: str, provider: str, info: PluginInfo | None, problems: list[str]
):
    """Adds one spec to its registry, recording which plugin provided it."""

    def register(spec: Any) -> None:
        try:
            registry.add(spec, provider)
        except DuplicateNameError as exc:
            problems.append(str(exc))
            return
        if info is not None:
            info.registers.setdefault(kind, []).append(spec.name)

    return register
