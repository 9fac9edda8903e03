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
import shlex
from collections.abc import Iterator
from typing import Any

from mega.core.config.resolve import resolve_config
from mega.errors import MegaUsageError

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


def _shapes(config: Any) -> Iterator[tuple[int, int, int, bool]]:
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
    name = f"tp{tp}" + ("-sp" if sp else "") + f" pp{pp}"
    if pp > 1:
        args += ["--pipeline-model-parallel-size", str(pp)]
        if vpp > 1:
            args += [
                "--virtual-pipeline-model-parallel-size",
                str(vpp),
                "--parallel",
                "interleaved",
            ]
            name += f"v{vpp}"
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
    config: Any, args: list[str], plugins: Any, rates: Any, usable_bytes: float
) -> list[Candidate]:
    """Every searched layout that fits, fastest first."""
    from mega.core.plan.estimate import plan_run

    base = _without_layout(args)
    gbs = config.global_batch_size  # the flags' (or their default): every layout trains it
    if config.training.global_batch_size is None:
        base += ["--global-batch-size", str(gbs)]  # else each layout's default would differ
    found = []
    for tp, pp, vpp, sp in _shapes(config):
        dp = config.world_size // (tp * pp * config.parallel.context_parallel_size)
        for mbs in (1, 2, 4, 8):
            if gbs % (mbs * dp):
                continue
            fitted = None
            for recompute in ("none", "selective", "full"):
                for distopt in (False, True) if dp > 1 else (False,):
                    layout, name = _layout_args(tp, pp, vpp, sp, mbs, recompute, distopt)
                    try:
                        candidate_config = resolve_config(
                            base + layout, plugins, this_machine=False
                        )
                    except MegaUsageError:
                        continue  # a combination the config refuses
                    plan = plan_run(candidate_config, plugins, rates)
                    if plan.peak_bytes <= usable_bytes:
                        fitted = Candidate(
                            base + layout, name, plan.tokens_per_second, plan.peak_bytes
                        )
                        break
                if fitted:
                    break
            if fitted is None:
                break  # a larger micro-batch needs more still
            found.append(fitted)
    return sorted(found, key=lambda c: -c.tokens_per_second)


def print_search(
    config: Any, args: list[str], plugins: Any, rates: Any, usable_bytes: float, top: int
) -> None:
    from rich.console import Console
    from rich.table import Table

    found = search(config, args, plugins, rates, usable_bytes)
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
