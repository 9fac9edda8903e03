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
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

# Innermost first: rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp))).
ORDER = ("tp", "cp", "ep", "dp", "pp")
# the groups spanning the cp coordinate too; each reuses a group of the same ranks made before
# it (build_topology): without context parallelism dpcp is dp, edpcp edp and tpcp tp
CP_GROUPS = ("dpcp", "edpcp", "tpcp")
# every group a rank may belong to: the dimensions, their combinations (``group_ranks``) and the
# pipeline's first-and-last-stage pair
GROUP_NAMES = (*ORDER, "mp", "edp", *CP_GROUPS, "embd")


def layout_problems(world_size: int, sizes: dict[str, int]) -> list[str]:
    """Why ``world_size`` cannot be split into these model-parallel sizes (empty when it can).

    ``sizes`` maps "tp", "cp", "ep" and "pp" to the requested sizes; "dp" is derived.
    """
    problems = [f"--{_FLAGS[k]} must be >= 1 (got {v})" for k, v in sizes.items() if v < 1]
    if problems:
        return problems
    model_parallel = math.prod(sizes.values())
    if world_size % model_parallel:
        factors = [(f"--{_FLAGS[k]}", v) for k, v in sizes.items() if v > 1]
        if len(factors) == 1:  # "by --tensor-model-parallel-size (2)", as the other checks say
            product = f"{factors[0][0]} ({factors[0][1]})"
        else:  # "by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4"
            product = " x ".join(f"{flag} {v}" for flag, v in factors) + f" = {model_parallel}"
        problems.append(f"the world size ({world_size} processes) is not divisible by {product}")
    return problems


_FLAGS = {
    "tp": "tensor-model-parallel-size",
    "cp": "context-parallel-size",
    "ep": "expert-model-parallel-size",
    "pp": "pipeline-model-parallel-size",
}


def group_ranks(world_size: int, sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """Every group of every dimension: ``{"tp": [[0, 1], [2, 3]], "dp": ..., "mp": ...}``.

    "mp" (model parallel) is tp x pp: the ranks that hold one copy of the dense model between
    them, over which a gradient norm is summed. "dp" varies the ep and dp coordinates (dense data
    parallelism), "edp" the dp coordinate alone (see the module docstring). With context
    parallelism (cp ranks hold the same weights and parts of the same sequences): "dpcp" varies
    cp, ep and dp (the ranks with the same dense weights, over which their gradients are
    reduced), "edpcp" cp and dp (the same experts), "tpcp" tp and cp (the ranks holding the
    other tokens of a micro-batch under sequence parallelism).
    """
    problems = layout_problems(world_size, sizes)
    if problems:
        raise ValueError("; ".join(problems))
    dims = {k: sizes.get(k, 1) for k in ORDER if k != "dp"}
    dims["dp"] = world_size // math.prod(dims.values())
    shape = [dims[k] for k in ORDER]

    def coords(rank: int) -> dict[str, int]:
        out = {}
        for name, size in zip(ORDER, shape, strict=True):
            out[name], rank = rank % size, rank // size
        return out

    groups: dict[str, list[list[int]]] = {}
    combined = {
        "mp": {"tp", "pp"}, "dp": {"ep", "dp"}, "edp": {"dp"},
        "dpcp": {"cp", "ep", "dp"}, "edpcp": {"cp", "dp"}, "tpcp": {"tp", "cp"},
    }  # fmt: skip
    for varying in [*ORDER, *combined]:
        axes = combined.get(varying, {varying})
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
        return (
            f"world {self.world_size} = {dp} x pp {self.pipeline_model_parallel_size} x cp "
            f"{self.context_parallel_size} x tp {self.tensor_model_parallel_size}"
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
) -> Topology:
    """The topology of an initialised process group; creates every group (collective call).
    The groups of the dimensions in ``high_priority`` (``--high-priority-stream-groups``) run
    their NCCL kernels on high-priority streams (no effect on other backends)."""
    sizes = {"tp": tp, "cp": cp, "ep": ep, "pp": pp}
    all_groups = group_ranks(world_size, sizes)
    members: dict[str, tuple[int, ...]] = {}
    groups: dict[str, Any] = {}
    if world_size > 1:
        import torch.distributed as dist

        created: dict[tuple[int, ...], Any] = {}
        for dim, ranks_lists in all_groups.items():
            for ranks in ranks_lists:
                key = tuple(ranks)
                if dim in CP_GROUPS and key in created:
                    # the same ranks as a group made already (every rank decides alike): no
                    # second communicator, e.g. dpcp is dp without context parallelism
                    group = created[key]
                else:
                    # every rank creates every group, in the same order (new_group is collective)
                    group = None
                    if len(ranks) > 1:
                        group = dist.new_group(ranks, pg_options=_options(dim in high_priority))
                    created.setdefault(key, group)
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
        members=members,
        groups=groups,
    )
