"""One hook for every parallel choice (``register_parallel_choices``): schedules, MoE dispatchers,
CP communication types and kinds no one has written yet, each spec's class naming its registry
(``choice_kind``). A new kind of choice lands without touching ``mega.core.plugins``: the toy
kind below is defined in this file only. The three hooks it replaced still work for a release,
with a DeprecationWarning pointing at the plugin's function."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import pytest

from mega import CPCommTypeSpec, MoEDispatcherSpec, PipelineScheduleSpec, hookimpl, make_plugins
from mega.core.plugins.registry import DEPRECATED_CHOICE_HOOKS
from mega.errors import MegaUsageError


@dataclass(frozen=True, kw_only=True)
class OverlapStrategySpec:
    """A kind of parallel choice mega does not have: defined by a plugin, nowhere else."""

    choice_kind: ClassVar[str] = "tp overlap strategy"
    name: str
    chunks: int = 2


class ToyChoices:
    @hookimpl
    def register_parallel_choices(self, register):
        register(OverlapStrategySpec(name="ring", chunks=4))
        register(OverlapStrategySpec(name="bulk"))
        register(MoEDispatcherSpec(name="toy-dispatcher", build=lambda group: None))


def test_a_new_kind_of_choice_gets_its_own_registry():
    plugins = make_plugins(load_entrypoints=False, extra=[("toy", ToyChoices())])
    registry = plugins.choices("tp overlap strategy")
    assert registry.names() == ["bulk", "ring"]
    assert registry.get("ring").chunks == 4 and registry.provider("ring") == "toy"
    assert plugins.moe_dispatchers.names() == ["toy-dispatcher"]  # beside the new kind
    with pytest.raises(MegaUsageError, match="tp overlap strategy 'rnig'.*ring"):
        registry.get("rnig")  # the registry's own kind in the message, a suggestion
    assert plugins.choices("no such kind").names() == []


def test_the_builtin_choices_come_through_the_one_hook():
    plugins = make_plugins()
    assert "interleaved" in plugins.parallel and "alltoall" in plugins.moe_dispatchers
    assert "p2p" in plugins.cp_comm_types
    for hook in DEPRECATED_CHOICE_HOOKS:  # mega's own plugins implement none of the old hooks
        assert getattr(plugins.pm.hook, hook).get_hookimpls() == [], hook
    builtin = {i.name: i for i in plugins.infos}
    assert builtin["cp_comm_types"].registers == {"cp comm type": ["p2p", "all_gather", "a2a"]}


class OldHooks:
    @hookimpl
    def register_parallel(self, register):
        register(PipelineScheduleSpec(name="old-table", table=lambda pp, vpp, m: {}))

    @hookimpl
    def register_moe_dispatchers(self, register):
        register(MoEDispatcherSpec(name="old-dispatcher", build=lambda group: None))

    @hookimpl
    def register_cp_comm_types(self, register):
        register(CPCommTypeSpec(name="old-ring", build=lambda *args: None))


def test_the_old_hooks_still_register_with_a_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugins = make_plugins(load_entrypoints=False, extra=[("old", OldHooks())])
    assert plugins.parallel.names() == ["old-table"]
    assert plugins.moe_dispatchers.names() == ["old-dispatcher"]
    assert plugins.cp_comm_types.names() == ["old-ring"]
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert sorted(str(w.message).split()[1] for w in deprecations) == sorted(
        DEPRECATED_CHOICE_HOOKS
    )
    assert all("register_parallel_choices" in str(w.message) for w in deprecations)
    assert {w.filename for w in deprecations} == {__file__}  # the plugin's own lines


def test_a_name_registered_by_old_and_new_hooks_clashes():
    class Both:
        @hookimpl
        def register_parallel_choices(self, register):
            register(MoEDispatcherSpec(name="twice", build=lambda group: None))

    class Old:
        @hookimpl
        def register_moe_dispatchers(self, register):
            register(MoEDispatcherSpec(name="twice", build=lambda group: None))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        plugins = make_plugins(load_entrypoints=False, extra=[("new", Both()), ("old", Old())])
    with pytest.raises(MegaUsageError, match="'twice' is registered by two plugins: 'new' and"):
        plugins.moe_dispatchers.get("twice")


def test_a_spec_without_a_choice_kind_is_the_plugins_failure():
    @dataclass(frozen=True)
    class Kindless:
        name: str

    class Broken:
        @hookimpl
        def register_parallel_choices(self, register):
            register(Kindless(name="x"))

    plugins = make_plugins(load_entrypoints=False, extra=[("broken", Broken())])
    (failure,) = plugins.failures()
    assert failure.name == "broken" and "has no choice_kind" in failure.error
    assert "broken" not in [name for name, _ in plugins.pm.list_name_plugin()]


def test_a_choice_kind_may_not_be_another_hooks_registry():
    @dataclass(frozen=True, kw_only=True)
    class SneakyModel:
        choice_kind: ClassVar[str] = "model"  # the models' registry is register_models'
        name: str

    class Sneaky:
        @hookimpl
        def register_parallel_choices(self, register):
            register(SneakyModel(name="gpt"))

    plugins = make_plugins(load_entrypoints=False, extra=[("sneaky", Sneaky())])
    (failure,) = plugins.failures()
    assert "as a parallel choice: register_models" in failure.error
    assert plugins.models.names() == []
