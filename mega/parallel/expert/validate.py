"""What the run's expert layout and MoE dispatcher need: pure Python, run before any process
group exists (``ExpertDimension.problems``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# which transport carries flex's trips: "padded" (mega.parallel.expert.padded_exchange: one
# all-to-all of fixed splits each way, any backend, nothing read on the host), "split"
# (mega.parallel.expert.split_exchange: the exact splits, by NVSHMEM on GPUs and by c10d reading
# the counts on the host on CPU ranks), or "auto": padded on GPUs, split on CPU ranks. On 2 H200
# (2026-11-30, 5e5c460) EP2 trained at 0.898x DP2 padded against 0.810x by NVSHMEM in the same
# run, and only the padded trips passed the overlapped schedule's race test (docs/moe.md).
# "copy-engine": the padded trips, their blocks copied into the peers' symmetric memory by the
# copy engine where the group's GPUs share a host (mega.parallel.expert.copy_engine_exchange;
# elsewhere, CPU ranks included, the group's all-to-all as "padded"); in order only.
# "peer-rows": the same, but only each block's real rows cross, written by a kernel (the
# padding's bytes stay home); in order only; what "auto" takes under CUDA graphs (below).
FLEX_TRANSPORT_ENV = "MEGA_FLEX_TRANSPORT"
FLEX_TRANSPORTS = ("auto", "padded", "split", "copy-engine", "peer-rows")  # first: the default
# the padded trips' maps, whatever carries them
PADDED_TRANSPORTS = ("padded", "copy-engine", "peer-rows")
IN_ORDER_TRANSPORTS = ("copy-engine", "peer-rows")  # symmetric memory's inbox: no overlap


# What "auto" means where the layers replay as CUDA graphs on GPUs (--cuda-graph-impl local):
# peer-rows. On 2 H200 (session 54, docs/moe.md) graphed EP2 ran at 0.958x, 0.9715x and 0.976x of
# DP2 over peer-rows against 0.932x and 0.931x over NCCL's padded trips in the same calls; without
# graphs peer-rows swung with the host's skew (0.863x and 0.928x against NCCL's 0.916x), so there
# "auto" keeps NCCL. Where the group's GPUs do not share a host peer-rows goes by the group's
# all-to-all, as "padded" does.
AUTO_UNDER_GRAPHS = "peer-rows"
_GRAPHED = [False]  # set by the training build (set_graphed_trips), read at each trip


def set_graphed_trips(graphed: bool) -> bool:
    """Whether this process's MoE layers replay as CUDA graphs on GPUs: ``auto`` then means
    :data:`AUTO_UNDER_GRAPHS` (``mega.core.training.build`` sets it for each model it builds,
    ``mega.parallel.distributed.finish_job`` clears it). Returns the previous setting."""
    before, _GRAPHED[0] = _GRAPHED[0], graphed
    return before


def flex_transport() -> str:
    """The transport flex's trips take: the environment's (checked before launch), or for
    ``auto`` under CUDA graphs :data:`AUTO_UNDER_GRAPHS`."""
    transport = os.environ.get(FLEX_TRANSPORT_ENV, FLEX_TRANSPORTS[0])
    if transport == "auto" and _GRAPHED[0]:
        return AUTO_UNDER_GRAPHS
    return transport


def padded_trips(on_gpus: bool | torch.device | None = None) -> bool:
    """Whether flex's trips go by the padded all-to-alls: asked for, or ``auto`` on GPUs.
    ``on_gpus``: whether the run is on GPUs, or the device of the data (CUDA, or meta: the
    planner plans GPU runs); by default whether this process sees CUDA."""
    transport = flex_transport()
    if transport != "auto":
        return transport in PADDED_TRANSPORTS
    if on_gpus is None:
        import torch  # here: the checks before launch import no torch

        return torch.cuda.is_available()
    if isinstance(on_gpus, bool):
        return on_gpus
    return on_gpus.type != "cpu"


def expert_problems(config: Any, plan: Any, plugins: Any) -> list[str]:
    """What the run's expert layout and MoE dispatcher need."""
    p = config.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    moe = plan is not None and bool(plan.moe_layers)
    errors = []
    if ep > 1 and not moe:
        errors.append(
            f"--expert-model-parallel-size {ep}: model '{config.model_name}' has no experts"
            " (give --num-experts)"
        )
    if not moe:
        return errors
    experts = getattr(config.model, "num_experts", None)
    if experts and experts % ep:
        errors.append(
            f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep})"
        )
    if tp > 1 and not p.sequence_parallel:
        errors.append(
            f"--tensor-model-parallel-size {tp} with experts needs --sequence-parallel"
            " (as in Megatron: each rank routes its own slice of the sequence)"
        )
    if plan.moe_overlap_comm and plan.moe_dispatcher != "flex":
        errors.append(
            "--overlap-moe-expert-parallel-comm: only the flex dispatcher overlaps its trips"
            f" (--moe-token-dispatcher-type flex, not {plan.moe_dispatcher})"
        )
    if plan.moe_overlap_comm and ep == 1:
        errors.append(
            "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size above 1"
            " (with one expert rank nothing travels)"
        )
    if plan.moe_dispatcher == "flex" and flex_transport() not in FLEX_TRANSPORTS:
        errors.append(
            f"{FLEX_TRANSPORT_ENV}={flex_transport()!r}: must be one of {', '.join(FLEX_TRANSPORTS)}"
        )
    dispatchers = plugins.moe_dispatchers
    if plan.moe_dispatcher not in dispatchers:
        errors.append(
            f"--moe-token-dispatcher-type {plan.moe_dispatcher!r}: no such dispatcher"
            f" (have: {', '.join(dispatchers.names())})"
        )
    elif (
        getattr(config.model, "moe_expert_capacity_factor", None) is not None
        and not dispatchers.peek(plan.moe_dispatcher).drops_tokens
    ):
        errors.append(
            f"--moe-expert-capacity-factor: the {plan.moe_dispatcher} dispatcher cannot drop tokens"
        )
    return errors


# NVSHMEM's 2D all-to-alls (the flex dispatcher on GPUs, mega.parallel.expert.split_exchange)
FLEX_MOST_RANKS, FLEX_MOST_LOCAL_EXPERTS = 16, 16


def flex_layout_problems(ep: int, world: int, local: int) -> list[str]:
    """The expert layouts NVSHMEM's all-to-all cannot carry: a group that is not every rank (its
    kernels address ranks by their number in the world and synchronise all of them), more than
    16 ranks or 16 local experts (its tiles). Before launch (:func:`flex_gpu_problems`) and at
    the first trip (a library caller's)."""
    errors = []
    if ep != world:
        errors.append(
            f"--moe-token-dispatcher-type flex on GPUs needs --expert-model-parallel-size equal"
            f" to the number of ranks ({ep} of {world}): NVSHMEM's all-to-all spans every rank"
        )
    if ep > FLEX_MOST_RANKS or local > FLEX_MOST_LOCAL_EXPERTS:
        errors.append(
            f"--moe-token-dispatcher-type flex on GPUs: {ep} expert-parallel ranks of {local}"
            f" local experts; NVSHMEM's all-to-all takes at most {FLEX_MOST_RANKS} ranks and"
            f" {FLEX_MOST_LOCAL_EXPERTS} local experts"
        )
    return errors


# On 2 H200 (2026-11-30, 3332b02) the overlapped schedule's race test failed over NVSHMEM (outputs
# and gradients off the in-order schedule's, on one rank or the other: tests/test_gpu_moe_flex.py),
# and a training run was slower with it (54,560 tokens/s per GPU against 66,129 in order). Over
# the padded trips the race test passed and EP2 trained as one GPU (a4ab9b5), but at 0.479x DP2
# against 0.854x in order in the same run (its chunks' trips on a side stream, run eager). With
# the grouped GEMM in bf16, GPUs now run the pipelined schedule instead (flex_schedule.pipelined:
# traced into the layer, no stream): right on 2 H200 (c1c71fd) but slower than in order (0.868x
# DP2 against 0.898x in the same run), so GPUs still refuse the flag.
# MEGA_FLEX_OVERLAP_ON_GPUS=1 runs it over the padded trips (its GPU tests, its measurements),
# never over NVSHMEM.
OVERLAP_ON_GPUS_ENV = "MEGA_FLEX_OVERLAP_ON_GPUS"
OVERLAP_ON_GPUS = (
    "--overlap-moe-expert-parallel-comm is not run on GPUs yet: on 2 H200 its first schedule"
    " trained EP2 at 0.48x of DP2 against 0.85x in order, its pipelined one at 0.87x against"
    " 0.90x (docs/moe.md)"
)
OVERLAP_IN_ORDER_ONLY = (
    "--overlap-moe-expert-parallel-comm with MEGA_FLEX_TRANSPORT={}: its inbox in symmetric"
    " memory carries the trips in order only"
)


def __getattr__(name: str) -> str:
    # the message's old name (until session 54 only copy-engine was in order only): kept a release
    if name == "OVERLAP_OVER_COPY_ENGINE":
        import warnings

        warnings.warn(
            "mega.parallel.expert.validate.OVERLAP_OVER_COPY_ENGINE is deprecated: use"
            " OVERLAP_IN_ORDER_ONLY.format('copy-engine')",
            DeprecationWarning,
            stacklevel=2,
        )
        return OVERLAP_IN_ORDER_ONLY.format("copy-engine")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


OVERLAP_OVER_NVSHMEM = (
    "--overlap-moe-expert-parallel-comm with MEGA_FLEX_TRANSPORT=split: over NVSHMEM the"
    " overlapped trips raced on 2 H200 (their outputs differed from flex in order)"
)


def flex_gpu_problems(config: Any) -> list[str]:
    """What ``--moe-token-dispatcher-type flex`` needs on GPUs where NVSHMEM carries it: the
    expert-parallel group must be every rank (its kernels address ranks by their number in the
    world and synchronise all of them), at most 16 ranks and 16 local experts, and no other user
    of torch's symmetric memory with another backend (the copy-engine ring of context
    parallelism: one backend per process), unless the padded all-to-alls carry the trips (the
    default on GPUs: none of NVSHMEM's limits); and no overlap (:data:`OVERLAP_ON_GPUS`, never
    over NVSHMEM)."""
    model, p = config.model, config.parallel
    if getattr(model, "moe_token_dispatcher_type", None) != "flex":
        return []
    ep, world = p.expert_model_parallel_size, config.world_size
    if ep <= 1:
        return []
    overlap = bool(getattr(model, "overlap_moe_expert_parallel_comm", False))
    errors = [OVERLAP_ON_GPUS] if overlap and os.environ.get(OVERLAP_ON_GPUS_ENV) != "1" else []
    if overlap and flex_transport() in IN_ORDER_TRANSPORTS:
        errors.append(OVERLAP_IN_ORDER_ONLY.format(flex_transport()))
    if padded_trips(on_gpus=True):  # NCCL's all-to-all: none of NVSHMEM's limits
        return errors
    if overlap and not errors:
        errors.append(OVERLAP_OVER_NVSHMEM)
    errors += flex_layout_problems(ep, world, (getattr(model, "num_experts", None) or 0) // ep)
    if p.context_parallel_size > 1:
        from mega.parallel.context.transport_choice import chosen_transport

        if chosen_transport() == "copy-engine":
            errors.append(
                "--moe-token-dispatcher-type flex with MEGA_CP_P2P_TRANSPORT=copy-engine: both"
                " use torch's symmetric memory, whose backend is one per process; use the nccl"
                " transport"
            )
    return errors
