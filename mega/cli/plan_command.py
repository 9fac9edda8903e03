"""``mega plan``: the memory of every pipeline stage and the step time of a launch, before it.

``mega plan [mega train's flags] [--gpus N] [--gpu h100|h200] [--gpu-memory GiB]`` builds each
pipeline stage's rank position on the meta device with mega's own code and counts one step
(``mega.core.plan``); no GPU and no process group. ``--search`` tries the layouts of ``--gpus``
GPUs and prints the fastest that fit as ``mega train`` command lines. ``--calibrate`` measures this
machine's GPU rates and saves them; later plans for that GPU kind use them.
"""

from __future__ import annotations

from typing import Any

import click

from mega import hookimpl
from mega.cli.flag_command import flag_command
from mega.cli.train_command import _help_sections as _train_help_sections
from mega.errors import MegaUsageError

GIB = 2**30
# what a plan may fill of a GPU: the rest is the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation
USABLE = 0.92
PLAN_FLAGS = """\
Plan flags:
  --gpus N             GPUs of the launch (sets --nproc-per-node; default: the flags' world size)
  --gpu KIND           h100 or h200 (rates and memory; default h200, or a --calibrate'd GPU)
  --gpu-memory GIB     memory per GPU (default: the kind's)
  --search             try the layouts of --gpus GPUs; print the fastest that fit
  --top K              how many --search prints (default 5)
  --jobs N             processes --search counts layouts in (default: the CPUs it may use)
  --calibrate          measure this machine's GPU rates and save them (needs a GPU)"""


def _help_sections(args: list[str], plugins: Any) -> tuple[str, dict[str, type]]:
    from mega.cli.train_command import USAGE as TRAIN_USAGE

    intro, sections = _train_help_sections(args, plugins)
    usage = "Usage: mega plan [mega train's flags] [--gpus N] [--gpu KIND] [--search]\n\n"
    usage += "Memory per GPU and step time of a launch, counted before it (no GPU needed).\n\n"
    return usage + PLAN_FLAGS + intro.removeprefix(TRAIN_USAGE), sections


def _take(args: list[str], flag: str, convert: Any = str, switch: bool = False) -> Any:
    """Remove ``flag`` (and its value: ``--flag V`` or ``--flag=V``) from ``args``; its value,
    True for a switch, or None."""
    joined = next((i for i, a in enumerate(args) if a.startswith(flag + "=")), None)
    if joined is not None and not switch:
        value = args.pop(joined).split("=", 1)[1]
    elif flag not in args:
        return None
    else:
        i = args.index(flag)
        if switch:
            del args[i]
            return True
        if i + 1 >= len(args):
            raise MegaUsageError(f"{flag} needs a value")
        value = args[i + 1]
        del args[i : i + 2]
    try:
        return convert(value)
    except ValueError:
        raise MegaUsageError(f"{flag}: not a valid value: {value!r}") from None


@flag_command("plan", _help_sections)
def plan_command(args_list: list[str], plugins: Any) -> None:
    """Memory per GPU and step time of a launch, before it (mega train's flags)."""
    args = list(args_list)
    gpus = _take(args, "--gpus", int)
    kind = _take(args, "--gpu")
    memory_gib = _take(args, "--gpu-memory", float)
    search = _take(args, "--search", switch=True)
    top = _take(args, "--top", int)
    jobs = _take(args, "--jobs", int)
    if memory_gib is not None and not 0 < memory_gib < float("inf"):
        raise MegaUsageError(f"--gpu-memory must be a positive number of GiB (got {memory_gib:g})")
    if top is not None and top < 1:
        raise MegaUsageError(f"--top must be >= 1 (got {top})")
    if jobs is not None and jobs < 1:
        raise MegaUsageError(f"--jobs must be >= 1 (got {jobs})")
    if jobs is not None and not search:
        raise MegaUsageError("--jobs is for --search (one plan is counted in this process)")
    if _take(args, "--calibrate", switch=True):
        _calibrate()
        return
    if gpus is not None:
        if gpus < 1:
            raise MegaUsageError(f"--gpus must be >= 1 (got {gpus})")
        for flag in ("--nproc-per-node", "--nproc_per_node", "--nnodes"):
            if flag in args:
                raise MegaUsageError(f"--gpus and {flag} both set the launch's size: give one")
        args += ["--nproc-per-node", str(gpus)]
    from mega.core.plan.calibration import GPU_MEMORY_GIB, rates_for

    kind = kind.lower() if kind else None
    rates = rates_for(kind)
    kind = kind or rates.kind
    if memory_gib is None:
        if kind not in GPU_MEMORY_GIB:
            raise MegaUsageError(f"--gpu {kind}: memory not known; give --gpu-memory")
        memory_gib = GPU_MEMORY_GIB[kind]
    from mega.core.config.resolve import resolve_config

    base = args
    if search and any(a.split("=")[0] == "--global-batch-size" for a in args):
        # the search picks the micro-batch: the flags' (or the default 16) must not fail the
        # global batch it will divide (the default's global batch depends on it: kept otherwise)
        from mega.cli.plan_search import without_micro_batch

        base = [*without_micro_batch(args), "--micro-batch-size", "1"]
    config = resolve_config(base, plugins, this_machine=False)  # planned for --gpu's kind
    if search:
        from mega.cli.plan_search import print_search

        usable = memory_gib * GIB * USABLE
        from mega.core.cores import available_cores

        print_search(config, args, plugins, rates, usable, top or 5, jobs or available_cores())
        return
    from mega.core.plan.estimate import plan_run

    plan = plan_run(config, plugins, rates)
    _print_plan(config, plan, kind, memory_gib)


def _calibrate() -> None:
    from mega.core.plan.calibration import calibration_path, measure_rates

    try:
        rates = measure_rates()
    except RuntimeError as exc:
        raise MegaUsageError(str(exc)) from None
    path = calibration_path()
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(rates.to_json())
        tmp.replace(path)  # never a half-written calibration
    except OSError as exc:
        raise MegaUsageError(f"cannot save the calibration to {path}: {exc.strerror}") from None
    click.echo(rates.to_json())
    click.echo(f"saved to {path}")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _print_plan(config: Any, plan: Any, kind: str, memory_gib: float) -> None:
    from rich.console import Console
    from rich.table import Table

    p = config.parallel
    world = config.world_size
    pp = p.pipeline_model_parallel_size
    title = (
        f"{config.model_name}, {world} x {kind.upper()} ({memory_gib:.0f} GiB):"
        f" tp {p.tensor_model_parallel_size} pp {pp} cp {p.context_parallel_size}"
        f" dp {world // (p.tensor_model_parallel_size * pp * p.context_parallel_size)},"
        f" micro-batch {config.training.micro_batch_size} x {config.num_microbatches}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("stage", "ranks", "params", "grads", "optimizer", "activations", "peak",
                   "fits"):  # fmt: skip
        table.add_column(column, justify="right")
    usable = memory_gib * USABLE
    for stage in plan.stages:
        profile = stage.profile
        state = profile.state_bytes
        first = stage.stage * (world // pp)
        ranks = f"{first}-{first + world // pp - 1}" if world // pp > 1 else str(first)
        peak = profile.peak_bytes / GIB
        table.add_row(
            str(stage.stage),
            ranks,
            _gib(state["parameters"]),
            _gib(state["gradients"]),
            _gib(state["optimizer"]),
            _gib(profile.peak_bytes - profile.static_bytes),
            f"{peak:.2f}",
            "yes" if peak <= usable else "NO",
        )
    console = Console(highlight=False, width=max(Console().width, 100))
    console.print(table)
    console.print("(GiB per GPU; activations: the peak's part above the state: activations,")
    console.print(" logits and loss, communication buffers and temporaries)")
    console.print(
        f"step {plan.step_seconds * 1e3:.1f} ms: pipeline {plan.pipeline_seconds * 1e3:.1f} ms"
        f" (bubble {plan.bubble:.1%}), exposed gradient sync"
        f" {plan.gradient_sync_seconds * 1e3:.1f} ms, optimizer {plan.optimizer_seconds * 1e3:.1f} ms"
    )
    console.print(
        f"tokens/s {plan.tokens_per_second:,.0f} ({plan.tokens_per_second / world:,.0f} per GPU);"
        f" rates: {plan.rates.source}"
    )
    for line in plan.assumptions:  # what the count took as given, or left out
        console.print(line)
    if plan.peak_bytes / GIB > usable:
        console.print(
            f"does not fit: the largest stage needs {plan.peak_bytes / GIB:.1f} GiB of"
            f" {usable:.1f} usable ({USABLE:.0%} of {memory_gib:.0f})"
        )


@hookimpl
def register_commands(register: Any) -> None:
    register(plan_command)
