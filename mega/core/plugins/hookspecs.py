"""The plugin contract: every hook a mega plugin can implement.

A plugin is a module (or object) with functions decorated by ``mega.hookimpl`` whose names match
the specifications below. Installed packages expose it through the ``mega`` entry-point group::

    [project.entry-points.mega]
    myplugin = "mega_myplugin"

Hooks come in two families.

*Registration hooks* (``register_*``) are called once per process, on every rank, when the plugin
manager is built. They receive a ``register`` callback; call it once per thing you provide.

*Lifecycle hooks* fire at most once per training step, never per layer or micro-batch, and never
inside a compiled region. Hooks that may run collectives say so and are called on every rank.
mega's own metrics sinks, plan check and "saved checkpoint" line are implementations of them
(``mega.plugins.lifecycle``). A hook may gain an argument: implementations name the arguments
they take, so ones written before it still run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("mega")
hookimpl = pluggy.HookimplMarker("mega")  # plugins take it from the package face, ``mega``


# --------------------------------------------------------------------------- registration


@hookspec
def register_models(register: Callable[[Any], None]) -> None:
    """Register model families.

    :param register: call ``register(ModelSpec(...))`` once per model. The spec's ``name`` is
        what users pass to ``mega train --model NAME``.

    Called on: every rank. When: once, while the plugin manager is built.
    A name already registered by another plugin is an error naming both plugins.
    """


@hookspec
def register_tokenizers(register: Callable[[Any], None]) -> None:
    """Register tokenizers.

    :param register: call ``register(TokenizerSpec(...))``. The name is what users pass to
        ``--tokenizer-type`` (use Megatron-LM's name when yours behaves like one of its tokenizers).

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_datasets(register: Callable[[Any], None]) -> None:
    """Register datasets.

    :param register: call ``register(DatasetSpec(...))``. The name is what users pass to
        ``--dataset``; ``build(config, request, context)`` returns train/valid/test splits.

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_parallel_choices(register: Callable[[Any], None]) -> None:
    """Register parallel choices: pipeline schedules, MoE token dispatchers, context-parallel
    communication types, and any kind a plugin adds.

    :param register: call ``register(spec)`` once per choice. The spec's class says which
        registry it joins by its ``choice_kind`` class attribute: ``PipelineScheduleSpec``
        (``"parallel"``, selected with ``--parallel NAME``: a table of actions that the one
        executor runs, ``mega.parallel.pipeline``), ``MoEDispatcherSpec`` (``"moe dispatcher"``,
        ``--moe-token-dispatcher-type NAME``: moves each token to the expert-parallel ranks of
        its experts and back, ``mega.parallel.expert``), ``CPCommTypeSpec`` (``"cp comm type"``,
        ``--cp-comm-type NAME``: causal attention over a sequence split across the
        context-parallel ranks, ``mega.parallel.context``). A new kind of choice is a new spec
        class with its own ``choice_kind``; its registry is ``plugins.choices(KIND)``, made
        when the first spec of that kind arrives (nothing in ``mega.core.plugins`` changes).

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_parallel(register: Callable[[Any], None]) -> None:
    """Deprecated since 2026-11-28: use ``register_parallel_choices`` (a ``PipelineScheduleSpec``
    says its own kind). Still called for a release, with a ``DeprecationWarning``; what it
    registers joins the ``--parallel`` choices.

    :param register: as ``register_parallel_choices``'.

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_checkpoint_backends(register: Callable[[Any], None]) -> None:
    """Register checkpoint backends.

    :param register: call ``register(CheckpointBackendSpec(...))``; users select one with
        ``--ckpt-format NAME``.

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_checkpoint_converters(register: Callable[[Any], None]) -> None:
    """Register checkpoint formats for ``mega convert-checkpoint``.

    :param register: call ``register(CheckpointConverterSpec(...))``; users name one with
        ``--to NAME`` (and SRC's is detected).

    Called on: the process running ``mega convert-checkpoint``. When: once, while the plugin
    manager is built.
    """


@hookspec
def register_moe_dispatchers(register: Callable[[Any], None]) -> None:
    """Deprecated since 2026-11-28: use ``register_parallel_choices`` (a ``MoEDispatcherSpec``
    says its own kind). Still called for a release, with a ``DeprecationWarning``.

    :param register: as ``register_parallel_choices``'.

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_cp_comm_types(register: Callable[[Any], None]) -> None:
    """Deprecated since 2026-11-28: use ``register_parallel_choices`` (a ``CPCommTypeSpec``
    says its own kind). Still called for a release, with a ``DeprecationWarning``.

    :param register: as ``register_parallel_choices``'.

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_optimizers(register: Callable[[Any], None]) -> None:
    """Register optimizer update rules.

    :param register: call ``register(OptimizerSpec(...))``; users select one with
        ``--optimizer NAME``. A rule is an element-wise update of flat fp32 masters and its
        per-element states (``mega.parallel.data.rules``); the optimizer around it keeps the
        masters, shards them over data-parallel ranks, clips, skips non-finite steps and saves
        the states. ``adam`` and ``sgd`` are built in.

    Called on: every rank. When: once, while the plugin manager is built.
    """


@hookspec
def register_commands(register: Callable[[Any], None]) -> None:
    """Register command-line commands.

    :param register: call ``register(command)`` with a ``click.Command`` or ``click.Group``;
        it becomes ``mega <command.name>``. Keep the module cheap to import: build heavy objects
        inside the command body, so that ``mega --help`` stays fast.

    Called on: the process that runs the ``mega`` command. When: the first time the command
    line needs the list of commands.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec
def validate_config(config: Any) -> list[str] | None:
    """Check the resolved run configuration.

    :param config: the resolved ``mega.core.config.sections.RunConfig`` (typed dataclasses, read-only by
        convention).
    :returns: a list of error messages (empty or ``None`` when all is well). Messages from every
        plugin are collected and shown together; the run does not start if there are any.

    Called on: every rank, before any process group or device is touched.
    When: once, after flags and config files are resolved.
    """


@hookspec
def topology_ready(topology: Any, engine: Any) -> None:
    """The process topology exists.

    :param topology: the run's ``mega.parallel.topology.Topology`` (world size, rank, groups).
        Collectives are allowed here, and then this hook must do the same ones on every rank.
    :param engine: the engine being set up: ``config``, ``plugins``, ``device`` and ``display``
        exist; its model, optimizer, data and log do not yet. (Added after the first release:
        an implementation may leave it out, as any hook's implementation may leave out
        arguments it does not use.)

    Called on: every rank. When: once, after process groups exist and before the model is built.
    """


@hookspec(firstresult=True)
def train_step(engine: Any, microbatches: list[dict[str, Any]], iteration: int) -> Any:
    """Run one optimizer step over one global batch.

    :param engine: the running ``mega.core.training.engine.Engine``.
    :param microbatches: the global batch, as this rank's list of micro-batch dicts of tensors.
    :param iteration: the 1-based number of the iteration this step produces.
    :returns: a ``mega.core.training.engine.StepResult``.

    The engine's own implementation (``trylast``) runs the selected ``--parallel`` schedule and
    the optimizer step. Plugins normally *wrap* it instead, with
    ``@hookimpl(wrapper=True)`` and ``result = yield`` (timing, profiling, NaN guards).

    Called on: every rank. When: once per iteration.
    """


@hookspec
def step_end(engine: Any, iteration: int, metrics: dict[str, float]) -> None:
    """An iteration finished; a place for metrics sinks (the built-in ones run first).

    :param engine: the running engine.
    :param iteration: the iteration just completed (1-based).
    :param metrics: floats already reduced across ranks: ``lm_loss``, ``learning_rate``,
        ``grad_norm``, ``loss_scale``, ``skipped_iterations``, ``nan_iterations``,
        ``consumed_samples``, ``elapsed_ms``, ``tokens_per_s``, ``tflops_per_gpu``, ...

    The metrics are synchronised from the device only on logging iterations; on other iterations
    ``metrics`` holds what is known without a host sync (``iteration``, ``consumed_samples``).

    Called on: every rank. When: once per iteration, after the optimizer step.
    """


@hookspec
def checkpoint_saved(path: str, iteration: int, engine: Any, seconds: float | None) -> None:
    """A checkpoint is complete: its marker has been written.

    :param path: the checkpoint's directory (``<save>/iter_0000100``).
    :param iteration: the iteration it holds.
    :param engine: the engine that saved it.
    :param seconds: how long the save held training up; ``None`` for an ``--async-save``
        checkpoint, written beside training and completed at the next save or the end.
        (``engine`` and ``seconds`` were added after the first release: an implementation may
        leave them out.)

    Called on: every rank. When: after each save, once the checkpoint is complete.
    """


@hookspec
def shutdown(engine: Any, exc: BaseException | None) -> None:
    """The run is ending.

    :param engine: the engine. When setup failed (``exc`` set), its model, optimizer or data may
        not exist yet: use ``getattr(engine, "model", None)``.
    :param exc: ``None`` on success, else the exception that is ending the run.

    Called on: every rank. When: once, at the end of ``Engine.train``, also on failure.
    """
