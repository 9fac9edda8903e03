"""Which transformer layers each pipeline stage holds. Pure Python: checked before any launch.

Megatron's rules (``get_num_layers_to_build``, ``get_transformer_layer_offset``):

- every pipeline rank holds the same number of layers, unless ``--decoder-first-pipeline-num-layers``
  or ``--decoder-last-pipeline-num-layers`` fixes the first or last rank's count; the remaining
  layers are spread evenly over the other ranks;
- a rank's layers are split evenly over its ``vpp`` model chunks (virtual stages). Local chunk ``c``
  of rank ``r`` is virtual stage ``c * pp + r``, and layers are numbered consecutively through the
  virtual stages in that order, so the model runs stage 0 (rank 0), stage 1 (rank 1), ...

The embedding runs on virtual stage 0 and the final norm, output layer and loss on the last one.
"""

from __future__ import annotations

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
    if rest_ranks and rest % rest_ranks:
        if fixed:
            return [], [
                f"the {rest} layers left after {FIRST}/{LAST} must split evenly over the other"
                f" {rest_ranks} pipeline ranks"
            ]
        below = num_layers // pp * pp
        hint = f"{below} or {below + pp}" if below else f"{pp}"
        return [], [
            f"--num-layers ({num_layers}) must be divisible by {PP} ({pp}): try --num-layers"
            f" {hint}, or split unevenly with {FIRST}/{LAST}"
        ]
    even = rest // rest_ranks if rest_ranks else 0
    return [fixed.get(r, even) for r in range(pp)], []


def layout_problems(
    num_layers: int, pp: int, vpp: int, first: int | None = None, last: int | None = None
) -> list[str]:
    """Why the layers cannot be split this way, one actionable line each (empty when they can)."""
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


def pipeline_layout(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> PipelineLayout:
    """The layers of every virtual stage; ``ValueError`` with the problems if there is no split."""
    problems = layout_problems(num_layers, pp, vpp, first, last)
    if problems:
        raise ValueError("; ".join(problems))
    counts, _ = _rank_counts(num_layers, pp, first, last)
    stages, start = [], 0
    for stage in range(pp * vpp):
        size = counts[stage % pp] // vpp
        stages.append(range(start, start + size))
        start += size
    return PipelineLayout(pp, vpp, tuple(stages))
