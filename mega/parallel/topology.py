"""The process topology: which rank this is, its coordinates, and its groups. One object, passed
explicitly; no module-global state.

Ranks are laid out in Megatron's order ``tp-cp-ep-dp-pp``: tensor parallel innermost (neighbouring
ranks, the fastest links), pipeline outermost. A one-process run has every size 1 and no groups.

Expert parallelism is carved out of data parallelism, as in Megatron: the ``ep`` ranks of a
group hold different experts *and* different data. So the data-parallel group (``dp``: the
ranks that hold the same dense weights and different data, over which dense gradients are
averaged) spans the ``ep`` and ``dp`` coordinates, and its size is ``world / (tp*cp*pp)``. The
ranks holding the same experts are the expert-data-parallel group ``edp`` (the ``dp`` coordinate
alone, ``dp / ep`` ranks), over which expert gradients are summed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

# Innermost first: rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp))). A plugin's parallel
# dimension (``mega.parallel.dimension``) puts its coordinate between ep and dp.
ORDER = ("tp", "cp", "ep", "dp", "pp")
# the derived groups whose ranks vary each coordinate, besides the coordinate's own group:
# e.g. "dpcp" (the ranks with the same dense weights) varies cp, ep and dp. "dp" as a group is
# the dense data-parallel one, which varies ep too (see the module docstring).
JOINS: dict[str, tuple[str, ...]] = {
    "tp": ("mp", "tpcp"),
    "cp": ("dpcp", "edpcp", "tpcp"),
    "ep": ("dp", "dpcp"),
    "dp": ("dp", "edp", "dpcp", "edpcp"),
    "pp": ("mp",),
}
# the groups spanning the cp coordinate too; each reuses its counterpart's group where it has the
# same ranks (build_topology): without context parallelism dpcp is dp, edpcp edp and tpcp tp. Only
# its counterpart's: a group of the same ranks made for another job is another communicator on
# purpose (EP2 on two GPUs: ep's ranks are dp's, and the experts' trips on the gradients' NCCL
# stream queued behind their reduce-scatters, 2 H200, 2026-11-30)
CP_COUNTERPART = {"dpcp": "dp", "edpcp": "edp", "tpcp": "tp"}
CP_GROUPS = tuple(CP_COUNTERPART)
DERIVED = ("mp", "edp", *CP_GROUPS)
# the groups whose ranks hold different data: a plugin's dimension may not join them (its ranks
# hold the same data, so that the batch arithmetic, micro-batch x dp, stays the engine's)
DATA_GROUPS = ("dp", "edp", "dpcp", "edpcp")
# every group a rank may belong to: the dimensions, their combinations (``group_ranks``) and the
# pipeline's first-and-last-stage pair
GROUP_NAMES = (*ORDER, *DERIVED, "embd")


def layout_problems(world_size: int, sizes: dict[str, int]) -> list[str]:
    """Why ``world_size`` cannot be split into these model-parallel sizes (empty when it can).

    ``sizes`` maps "tp", "cp", "ep" and "pp" (and a plugin's dimensions) to the requested
    sizes; "dp" is derived.
    """
    problems = [
        setting(k, v, "{} must be >= 1 (got {})") + ("" if k in _FLAGS else " must be >= 1")
        for k, v in sizes.items()
        if v < 1
    ]
    if problems:
        return problems
    model_parallel = math.prod(sizes.values())
    if world_size % model_parallel:
        factors = [(k, v) for k, v in sizes.items() if v > 1]
        if len(factors) == 1:  # "by --tensor-model-parallel-size (2)", as the other checks say
            product = setting(*factors[0], "{} ({})")
        else:  # "by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4"
            product = " x ".join(setting(k, v, "{} {}") for k, v in factors)
            product += f" = {model_parallel}"
        problems.append(f"the world size ({world_size} processes) is not divisible by {product}")
    return problems


_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
}


def setting(dim: str, size: int, form: str) -> str:
    """``dim`` at ``size`` in a message: ``form`` filled with its flag and the size (e.g.
    "{} ({})": "--tensor-model-parallel-size (2)"); a plugin's dimension, whose size is set as
    NAME=SIZE, always as "--extra-parallel-size rc=2"."""
    if dim in _FLAGS:
        return form.format(_FLAGS[dim], size)
    return f"--extra-parallel-size {dim}={size}"


def coordinates(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The rank's coordinates, innermost first, with a plugin's dimensions (``extra``)."""
    return (*ORDER[:3], *extra, *ORDER[3:])


def group_ranks(
    world_size: int,
    sizes: dict[str, int],
    joins: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, list[list[int]]]:
    """Every group of every dimension: ``{"tp": [[0, 1], [2, 3]], "dp": ..., "mp": ...}``.

    "mp" (model parallel) is tp x pp: the ranks that hold one copy of the dense model between
    them, over which a gradient norm is summed. "dp" varies the ep and dp coordinates (dense data
    parallelism), "edp" the dp coordinate alone (see the module docstring). With context
    parallelism (cp ranks hold the same weights and parts of the same sequences): "dpcp" varies
    cp, ep and dp (the ranks with the same dense weights, over which their gradients are
    reduced), "edpcp" cp and dp (the same experts), "tpcp" tp and cp (the ranks holding the
    other tokens of a micro-batch under sequence parallelism).

    ``sizes`` may name a plugin's dimensions besides "tp", "cp", "ep" and "pp" (their
    coordinates sit between ep and dp, in the order given); ``joins`` says which derived groups
    (``DERIVED``, not ``DATA_GROUPS``) each of them varies in too.
    """
    problems = layout_problems(world_size, sizes)
    if problems:
        raise ValueError("; ".join(problems))
    extra = [k for k in sizes if k not in ORDER]
    joined = {**JOINS, **{k: tuple((joins or {}).get(k, ())) for k in extra}}
    dims = {k: sizes.get(k, 1) for k in coordinates(extra) if k != "dp"}
    dims["dp"] = world_size // math.prod(dims.values())
    order = coordinates(extra)
    shape = [dims[k] for k in order]

    def coords(rank: int) -> dict[str, int]:
        out = {}
        for name, size in zip(order, shape, strict=True):
            out[name], rank = rank % size, rank // size
        return out

    groups: dict[str, list[list[int]]] = {}
    for varying in [*order, *DERIVED]:
        axes = {k for k in order if varying in joined[k]}
        if varying in order and varying not in axes and not axes:
            axes = {varying}  # a coordinate's own group (dp's is the derived one above)
        by_key: dict[tuple, list[int]] = {}
        for rank in range(world_size):
            c = coords(rank)
            key = tuple(v for k, v in c.items() if k not in axes)
            by_key.setdefault(key, []).append(rank)
        groups[varying] = list(by_key.values())
    return groups


@dataclass(frozen=True, kw_only=True)
class Topology:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # a plugin's dimensions (``mega.parallel.dimension``): name -> size, coordinates between ep
    # and dp in this order; their ranks hold the same data
    extra_sizes: dict[str, int] = field(default_factory=dict)
    # dimension -> the ranks of this rank's group, in group-rank order
    members: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    # dimension -> torch.distributed ProcessGroup (absent in a one-process run)
    groups: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def data_parallel_size(self) -> int:
        """Ranks with the same dense weights and different data (expert-parallel ones too)."""
        model_parallel = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * math.prod(self.extra_sizes.values())
        )
        return self.world_size // model_parallel

    @property
    def data_context_parallel_size(self) -> int:
        """Ranks with the same dense weights (the ``dpcp`` group): data x context parallel."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks with the same experts and different data."""
        return self.data_parallel_size // self.expert_model_parallel_size

    @property
    def expert_data_context_parallel_size(self) -> int:
        """Ranks with the same experts (the ``edpcp`` group): expert data x context parallel."""
        return self.expert_data_parallel_size * self.context_parallel_size

    def group_rank(self, dim: str) -> int:
        """This rank's index inside its ``dim`` group (0 in a one-process run)."""
        members = self.members.get(dim)
        return members.index(self.rank) if members else 0

    def group(self, dim: str) -> Any:
        """The ProcessGroup of ``dim`` ("tp", "cp", "ep", "dp", "edp", "pp", "mp", and with context
        parallelism "dpcp", "edpcp", "tpcp"), None if size 1;
        "embd" is the first and last pipeline stage, on those ranks only."""
        return self.groups.get(dim)

    @property
    def tp_rank(self) -> int:
        return self.group_rank("tp")

    @property
    def dp_rank(self) -> int:
        return self.group_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.group_rank("pp")

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        ep = self.expert_model_parallel_size
        dp = f"dp {self.data_parallel_size}"
        if ep > 1:  # the experts' split of the data-parallel ranks
            dp = f"dp {self.data_parallel_size} (ep {ep} x edp {self.expert_data_parallel_size})"
        extra = "".join(f" x {name} {size}" for name, size in self.extra_sizes.items())
        return (
            f"world {self.world_size} = {dp}{extra} x pp {self.pipeline_model_parallel_size} x "
            f"cp {self.context_parallel_size} x tp {self.tensor_model_parallel_size}"
        )


def _options(high_priority: bool) -> Any:
    """A new group's backend options: an NCCL group on a high-priority stream where asked.

    Where a group's collective overlaps compute (the backward's all-reduce beside the weight-
    gradient GEMM, the gradient buckets beside backward), its kernel must get SMs while the
    compute stream's kernels hold them; at normal priority it waits for them, and the ranks of a
    ring wait for each other (Megatron's ``--high-priority-stream-groups``)."""
    import torch.distributed as dist

    if not high_priority or dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def build_topology(
    world_size: int,
    rank: int,
    *,
    local_rank: int = 0,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    pp: int = 1,
    high_priority: Collection[str] = (),
    extra: dict[str, int] | None = None,
    joins: dict[str, tuple[str, ...]] | None = None,
) -> Topology:
    """The topology of an initialised process group; creates every group (collective call).
    The groups of the dimensions in ``high_priority`` (``--high-priority-stream-groups``) run
    their NCCL kernels on high-priority streams (no effect on other backends). ``extra``: a
    plugin's dimensions and their sizes, ``joins`` the derived groups each varies in too."""
    extra = dict(extra or {})
    allowed = set(DERIVED) - set(DATA_GROUPS)
    for name, joined in (joins or {}).items():
        if name in extra and set(joined) - allowed:
            raise ValueError(
                f"parallel dimension '{name}' joins {sorted(set(joined) - allowed)}: a "
                f"plugin's dimension may join only {sorted(allowed)}"
            )
    sizes = {"tp": tp, "cp": cp, "ep": ep, "pp": pp, **extra}
    all_groups = group_ranks(world_size, sizes, joins)
    members: dict[str, tuple[int, ...]] = {}
    groups: dict[str, Any] = {}
    if world_size > 1:
        import torch.distributed as dist

        created: dict[tuple[str, tuple[int, ...]], Any] = {}
        for dim, ranks_lists in all_groups.items():
            for ranks in ranks_lists:
                key = tuple(ranks)
                counterpart = (CP_COUNTERPART.get(dim, ""), key)
                if counterpart in created:
                    # its counterpart's ranks (every rank decides alike): no second
                    # communicator, e.g. dpcp is dp without context parallelism
                    group = created[counterpart]
                else:
                    # every rank creates every group, in the same order (new_group is collective)
                    group = None
                    if len(ranks) > 1:
                        # without cp a cp group is this one: its name asks for this one's stream
                        names = {dim} | {c for c, base in CP_COUNTERPART.items() if base == dim}
                        urgent = bool((names if cp == 1 else {dim}) & set(high_priority))
                        group = dist.new_group(ranks, pg_options=_options(urgent))
                created[(dim, key)] = group
                if rank in ranks:
                    members[dim] = key
                    if group is not None:
                        groups[dim] = group
        # the first and last stage of each pipeline: they sum the tied embeddings' gradients
        for ranks in all_groups["pp"] if pp > 1 else []:
            pair = [ranks[0], ranks[-1]]
            group = dist.new_group(pair, pg_options=_options("embd" in high_priority))
            if rank in pair:
                members["embd"], groups["embd"] = tuple(pair), group
    else:
        members = {dim: (0,) for dim in all_groups}
    return Topology(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        extra_sizes=extra,
        members=members,
        groups=groups,
    )
