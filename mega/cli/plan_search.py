"""``mega plan --search``: the layouts of a GPU count, counted, the fastest that fit first.

Varied: tensor parallel size (dividing the heads, at most 8), sequence parallelism with it,
pipeline size (dividing the layers) with 1 or 2 virtual stages (interleaved), the micro-batch
size, recomputation (none, selective, full) and the distributed optimizer. The rest (model,
data, precision, global batch) is the user's. Pruned as memory allows: per layout, recompute
and the distributed optimizer are tried from the fastest (none, without) to the most frugal and
the first that fits is kept; a micro-batch size that does not fit even with full recompute ends
that layout's larger ones. Context and expert parallelism are not searched (given, they are
kept).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import click
from rich.console import Console

from mega.core.config.resolve import resolve_config
from mega.errors import MegaRunError, MegaUsageError

# flags a layout sets: removed from the user's before a layout's are added (value-taking first)
_VALUED = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--micro-batch-size", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--parallel",
)  # fmt: skip
_SWITCHES = ("--sequence-parallel", "--use-distributed-optimizer", "--recompute-activations")
_RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-activations"],
    "full": [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ],
}  # fmt: skip


@dataclasses.dataclass
class Candidate:
    args: list[str]  # the full mega train flags
    layout: str  # short name
    tokens_per_second: float
    peak_bytes: int


def _without(args: list[str], valued: tuple[str, ...], switches: tuple[str, ...] = ()) -> list[str]:
    """``args`` less the flags ``valued`` (with their values) and ``switches``."""
    out, i = [], 0
    while i < len(args):
        word = args[i]
        if word.split("=", 1)[0] in valued:
            i += 1 if "=" in word else 2
            continue
        if word not in switches:
            out.append(word)
        i += 1
    return out


def _without_layout(args: list[str]) -> list[str]:
    return _without(args, _VALUED, _SWITCHES)


def without_micro_batch(args: list[str]) -> list[str]:
    """``args`` less ``--micro-batch-size`` (and its value)."""
    return _without(args, ("--micro-batch-size",))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


Shape = tuple[int, int, int, bool]  # tp, pp, vpp, sequence parallel


def _shapes(config: Any) -> Iterator[Shape]:
    """(tp, pp, vpp, sequence parallel) of the world size that the model's shapes allow."""
    world = config.world_size // config.parallel.context_parallel_size
    layers = getattr(config.model, "num_layers", None)
    heads = getattr(config.model, "num_attention_heads", None)
    for tp in _divisors(world):
        if tp > 8 or (heads is not None and heads % tp):
            continue
        for pp in _divisors(world // tp):
            if layers is not None and layers % pp:
                continue
            for vpp in (1, 2) if pp > 1 else (1,):
                if layers is not None and layers % (pp * vpp):
                    continue
                for sp in (False, True) if tp > 1 else (False,):
                    yield tp, pp, vpp, sp


def _layout_args(tp: int, pp: int, vpp: int, sp: bool, mbs: int, recompute: str, distopt: bool):
    args = ["--tensor-model-parallel-size", str(tp), "--micro-batch-size", str(mbs)]
    name = _shape_name((tp, pp, vpp, sp))
    if pp > 1:
        args += ["--pipeline-model-parallel-size", str(pp)]
        if vpp > 1:
            args += [
                "--virtual-pipeline-model-parallel-size",
                str(vpp),
                "--parallel",
                "interleaved",
            ]
        else:
            args += ["--parallel", "1f1b"]
    if sp:
        args.append("--sequence-parallel")
    if distopt:
        args.append("--use-distributed-optimizer")
    args += _RECOMPUTE[recompute]
    name += f" mb{mbs}" + ("" if recompute == "none" else f" {recompute}")
    name += " distopt" if distopt else ""
    return args, name


def search(
    config: Any,
    args: list[str],
    plugins: Any,
    rates: Any,
    usable_bytes: float,
    jobs: int = 1,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Candidate]:
    """Every searched layout that fits, fastest first. ``jobs`` processes count the layouts
    (forked, where the platform can; one plan of a 6.7B model takes seconds and a search of 8
    GPUs hundreds of them); ``progress(done, total, layout)`` hears of each (tp, pp, vpp, sp)
    shape as it is done. The result does not depend on ``jobs``."""
    base = _without_layout(args)
    gbs = config.global_batch_size  # the flags' (or their default): every layout trains it
    if config.training.global_batch_size is None:
        base += ["--global-batch-size", str(gbs)]  # else each layout's default would differ
    global _JOB
    _JOB = (config, base, plugins, rates, usable_bytes)
    try:
        by_shape = _each_shape(list(_shapes(config)), jobs, progress)
    finally:
        _JOB = None
    found = [candidate for shape in by_shape for candidate in shape]
    return sorted(found, key=lambda c: -c.tokens_per_second)


# what the shapes' workers share: set before they fork, so nothing of it is pickled (a plugin
# manager is not picklable; a forked worker has the parent's, third-party plugins included)
_JOB: tuple | None = None


def _shape_name(shape: Shape) -> str:
    tp, pp, vpp, sp = shape
    return f"tp{tp}" + ("-sp" if sp else "") + f" pp{pp}" + (f"v{vpp}" if vpp > 1 else "")


def _each_shape(
    shapes: list[Shape], jobs: int, progress: Callable[[int, int, str], None] | None
) -> list[list[Candidate]]:
    """``_search_shape`` of every shape, in shape order, serially or by ``jobs`` forked
    processes (the workers are started before any thread of this process, such as a progress
    bar's: forking a threaded process can deadlock the child)."""
    count = len(shapes)
    results: list[list[Candidate]] = [[] for _ in range(count)]
    jobs = min(jobs, count)
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        if progress:
            progress(0, count, "")
        for i, shape in enumerate(shapes):
            results[i] = _search_shape(shape)
            if progress:
                progress(i + 1, count, _shape_name(shape))
        return results
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(_search_shape, shape): i for i, shape in enumerate(shapes)}
        if progress:  # after the fork: a progress bar's thread may start now
            progress(0, count, "")
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            try:
                results[i] = future.result()  # a worker's error (one line) is raised here
            except BrokenProcessPool as exc:  # killed (out of memory?) rather than failed
                raise MegaRunError(
                    f"mega plan --search: a worker process died counting"
                    f" {_shape_name(shapes[i])} ({exc});"
                    " --jobs 1 counts every layout in this process"
                ) from None
            if progress:
                progress(done, count, _shape_name(shapes[i]))
    return results


def _search_shape(shape: Shape) -> list[Candidate]:
    """The layouts of ``shape``: for each micro-batch size, the fastest recompute and optimizer
    setting that fits (none if even full recompute does not)."""
    from mega.core.plan.estimate import plan_run

    config, base, plugins, rates, usable_bytes = _JOB
    tp, pp, vpp, sp = shape
    gbs = config.global_batch_size
    dp = config.world_size // (tp * pp * config.parallel.context_parallel_size)
    found = []
    for mbs in (1, 2, 4, 8):
        if gbs % (mbs * dp):
            continue
        fitted = None
        for recompute in ("none", "selective", "full"):
            for distopt in (False, True) if dp > 1 else (False,):
                layout, name = _layout_args(tp, pp, vpp, sp, mbs, recompute, distopt)
                try:
                    candidate_config = resolve_config(base + layout, plugins, this_machine=False)
                except MegaUsageError:
                    continue  # a combination the config refuses
                plan = plan_run(candidate_config, plugins, rates)
                if plan.peak_bytes <= usable_bytes:
                    fitted = Candidate(base + layout, name, plan.tokens_per_second, plan.peak_bytes)
                    break
            if fitted:
                break
        if fitted is None:
            break  # a larger micro-batch needs more still
        found.append(fitted)
    return found


class _SearchProgress:
    """``progress`` of :func:`search`: a transient rich bar on a terminal; elsewhere (a log, a
    pipe) a line on stderr per shape done. Started by the first call, which comes after the
    workers have forked."""

    def __init__(self, tty: bool):
        self.tty = tty
        self.started = time.perf_counter()
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.tty:
            if self.bar is None:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                self.bar = Progress(
                    TextColumn("searching layouts"), BarColumn(), TextColumn("{task.completed}/"
                    "{task.total} shapes"), TimeElapsedColumn(), TextColumn("{task.description}"),
                    transient=True, console=Console(stderr=True),
                )  # fmt: skip
                self.bar.start()
                self.task = self.bar.add_task("", total=total)
            self.bar.update(self.task, completed=done, description=name)
        elif done:
            seconds = time.perf_counter() - self.started
            click.echo(
                f"searched {done}/{total} layout shapes ({name}) in {seconds:.0f} s", err=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_search(
    config: Any,
    args: list[str],
    plugins: Any,
    rates: Any,
    usable_bytes: float,
    top: int,
    jobs: int = 1,
) -> None:
    from rich.table import Table

    progress = _SearchProgress(sys.stderr.isatty())
    try:
        found = search(config, args, plugins, rates, usable_bytes, jobs, progress)
    finally:
        progress.close()
    console = Console(highlight=False)
    if not found:
        console.print(f"no searched layout fits {usable_bytes / 2**30:.1f} GiB per GPU")
        return
    table = Table(title=f"fastest layouts that fit, {config.world_size} GPUs", title_justify="left")
    for column in ("", "layout", "tokens/s", "peak GiB"):
        table.add_column(column, justify="right")
    for i, c in enumerate(found[:top], 1):
        table.add_row(
            str(i), c.layout, f"{c.tokens_per_second:,.0f}", f"{c.peak_bytes / 2**30:.1f}"
        )
    console.print(table)
    for i, c in enumerate(found[:top], 1):
        console.print(f"{i}. mega train {shlex.join(c.args)}", soft_wrap=True)
