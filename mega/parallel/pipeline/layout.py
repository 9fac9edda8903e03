"""Which transformer layers each pipeline stage holds. Pure Python: checked before any launch.

Megatron's rules (``get_num_layers_to_build``, ``get_transformer_layer_offset``):

- every pipeline rank holds the same number of layers, unless ``--decoder-first-pipeline-num-layers``
  or ``--decoder-last-pipeline-num-layers`` fixes the first or last rank's count; the remaining
  layers are spread evenly over the other ranks;
- a rank's layers are split evenly over its ``vpp`` model chunks (virtual stages). Local chunk ``c``
  of rank ``r`` is virtual stage ``c * pp + r``, and layers are numbered consecutively through the
  virtual stages in that order, so the model runs stage 0 (rank 0), stage 1 (rank 1), ...

The embedding runs on virtual stage 0 and the final norm, output layer and loss on the last one.

``--pipeline-model-parallel-layout`` (Megatron's) sets every virtual stage's layers instead, in
virtual-stage order: ``Et*7|t*6|t*6|t*5L`` is 2 ranks x 2 chunks with 7, 6, 6 and 5 layers (rank 0
holds stages 0 and 2). ``E`` (embedding) must open the first stage and ``L`` (loss) close the last;
``t*N`` is N layers, ``(...)*N`` repeats a group, commas and spaces are ignored. It is how a
stage that also computes the output layer and loss gets fewer layers to even out the ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PP = "--pipeline-model-parallel-size"
VPP = "--virtual-pipeline-model-parallel-size"
VPP_LAYERS = "--num-layers-per-virtual-pipeline-stage"
FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    vpp: int
    stages: tuple[range, ...]  # the layers of each virtual stage, by virtual stage index

    @property
    def last_stage(self) -> int:
        return self.pp * self.vpp - 1

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of local chunk ``chunk`` on pipeline rank ``rank``."""
        return chunk * self.pp + rank

    def rank_layers(self, rank: int) -> list[int]:
        """Every layer pipeline rank ``rank`` holds, over all its chunks, in order."""
        return [i for c in range(self.vpp) for i in self.stages[self.stage(rank, c)]]

    def describe(self) -> str:
        """``[0-5] [6-11] | [12-17] [18-23]``-style: each rank's chunks, ranks split by ``|``."""

        def span(layers: range) -> str:
            return f"[{layers.start}-{layers.stop - 1}]" if len(layers) else "[]"

        ranks = [
            " ".join(span(self.stages[self.stage(r, c)]) for c in range(self.vpp))
            for r in range(self.pp)
        ]
        return " | ".join(ranks)


def virtual_stages_per_rank(
    num_layers: int, pp: int, vpp: int | None, layers_per_virtual_stage: int | None
) -> tuple[int, list[str]]:
    """The model chunks per rank set by ``--virtual-pipeline-model-parallel-size`` or
    ``--num-layers-per-virtual-pipeline-stage`` (1 when neither is given), and the problems."""
    if layers_per_virtual_stage is None:
        return vpp or 1, []
    per_rank = num_layers // pp
    if num_layers % pp or per_rank % layers_per_virtual_stage:
        return 1, [
            f"{VPP_LAYERS} ({layers_per_virtual_stage}) must divide the layers per pipeline rank"
            f" (--num-layers {num_layers} / {PP} {pp}"
            + (f" = {per_rank})" if num_layers % pp == 0 else ", which does not divide)")
        ]
    return per_rank // layers_per_virtual_stage, []


def _rank_counts(
    num_layers: int, pp: int, first: int | None, last: int | None
) -> tuple[list[int], list[str]]:
    """Layers per pipeline rank; the problems when the flags cannot be met."""
    fixed = {r: n for r, n in ((0, first), (pp - 1, last)) if n is not None}
    if pp == 1 and fixed:
        return [], [f"{FIRST}/{LAST} need {PP} > 1"]
    rest_ranks = pp - len(fixed)
    rest = num_layers - sum(fixed.values())
    if rest < 0 or (rest_ranks == 0 and rest != 0):
        return [], [
            f"{FIRST}/{LAST} ({first}, {last}) do not add up with --num-layers {num_layers}"
            f" over {PP} {pp}"
        ]
    if rest_ranks and rest % rest_ranks:  # (an even split without flags is checked earlier)
        return [], [
            f"the {rest} layers left after {FIRST}/{LAST} must split evenly over the other"
            f" {rest_ranks} pipeline ranks"
        ]
    even = rest // rest_ranks if rest_ranks else 0
    return [fixed.get(r, even) for r in range(pp)], []


def layout_problems(
    num_layers: int, pp: int, vpp: int, first: int | None = None, last: int | None = None
) -> list[str]:
    """Why the layers cannot be split this way, one actionable line each (empty when they can)."""
    if num_layers < 1:
        return [f"--num-layers must be at least 1 (got {num_layers})"]
    stages = pp * vpp
    if first is None and last is None and num_layers % stages:
        split = f"{PP} ({pp})"
        if vpp > 1:
            split = (
                f"{PP} x virtual stages per rank ({pp} x {vpp} = {stages};"
                f" set by {VPP} or {VPP_LAYERS})"
            )
        below = num_layers // stages * stages
        hint = f"{below} or {below + stages}" if below else f"{stages}"
        return [
            f"--num-layers ({num_layers}) must be divisible by {split} so every stage gets the"
            f" same layers: try --num-layers {hint}, or split unevenly with {FIRST}/{LAST}"
            f" or {LAYOUT}"
        ]
    counts, problems = _rank_counts(num_layers, pp, first, last)
    if problems:
        return problems
    for rank, count in enumerate(counts):
        if count % vpp:
            where = "the first" if rank == 0 else "the last" if rank == pp - 1 else "each middle"
            return [
                f"{where} pipeline rank holds {count} layers, which do not split into {vpp}"
                f" virtual stages ({VPP}/{VPP_LAYERS}): use a multiple of {vpp}"
            ]
    return []


LAYOUT = "--pipeline-model-parallel-layout"
_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)")


def parse_layout(text: str) -> tuple[list[int], list[str]]:
    """Layers per virtual stage from a ``--pipeline-model-parallel-layout`` string, and the
    problems (empty list of stages when there are any)."""
    flat = re.sub(r"[\s,]", "", text)
    while _REPEAT.search(flat):  # innermost groups first
        flat = _REPEAT.sub(lambda m: m[1] * int(m[2]), flat)
    flat = re.sub(r"t\*(\d+)", lambda m: "t" * int(m[1]), flat)
    stages = flat.split("|")
    bad = sorted(set(re.sub(r"[EtL|]", "", flat)))
    if bad:
        return [], [
            f"{LAYOUT} '{text}': unknown symbols {' '.join(bad)} (use E, t, L, t*N, (...)*N, |)"
        ]
    if not stages[0].startswith("E") or flat.count("E") != 1:
        return [], [f"{LAYOUT} '{text}': E (the embedding) must open the first stage, once"]
    if not stages[-1].endswith("L") or flat.count("L") != 1:
        return [], [f"{LAYOUT} '{text}': L (the loss) must close the last stage, once"]
    return [stage.count("t") for stage in stages], []


def explicit_layout_problems(counts: list[int], num_layers: int, pp: int, vpp: int) -> list[str]:
    """Whether a parsed layout fits the model and the pipeline size."""
    problems = []
    if len(counts) % pp:
        problems.append(f"{LAYOUT} has {len(counts)} stages, not a multiple of {PP} ({pp})")
    elif vpp > 1 and len(counts) != pp * vpp:
        problems.append(
            f"{LAYOUT} has {len(counts)} stages, but {PP} x virtual stages is {pp} x {vpp}"
        )
    if sum(counts) != num_layers:
        problems.append(f"{LAYOUT} places {sum(counts)} layers, but --num-layers is {num_layers}")
    return problems


def pipeline_layout(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    first: int | None = None,
    last: int | None = None,
    counts: list[int] | None = None,
) -> PipelineLayout:
    """The layers of every virtual stage, from the even/uneven split or from explicit per-stage
    ``counts`` (a parsed layout); ``ValueError`` with the problems if there is no split."""
    if counts is not None:
        problems = explicit_layout_problems(counts, num_layers, pp, vpp)
        vpp = len(counts) // pp
    else:
        problems = layout_problems(num_layers, pp, vpp, first, last)
    if problems:
        raise ValueError("; ".join(problems))
    if counts is None:
        per_rank, _ = _rank_counts(num_layers, pp, first, last)
        counts = [per_rank[stage % pp] // vpp for stage in range(pp * vpp)]
    stages, start = [], 0
    for size in counts:
        stages.append(range(start, start + size))
        start += size
    return PipelineLayout(pp, vpp, tuple(stages))
