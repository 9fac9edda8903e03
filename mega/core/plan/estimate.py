"""A launch's plan: every pipeline stage's memory and the step time, from counted work and rates.

Each pipeline stage is one rank position (``profile_rank``: the ranks of one stage differ only in
which data and which shard they hold). Its time per micro-batch is the larger of what the GPU
takes (matmul FLOPs, attention FLOPs at the rates of the run's sequence length, bytes moved by
the other ops, each at its calibrated rate, plus the tensor/context/expert-parallel collectives,
which sit between the ops that need them, and the part of the copy-engine split's transfers that
outlasts the GEMM beside them) and what the host takes to launch its ops. Across
stages the schedule's table runs in the pipeline simulator with the slowest stage's chunk costs,
which gives the pipeline's time with its bubble. Then, once per global batch: the data-parallel
gradient reduction (of which the part longer than the last micro-batch's backward is exposed
when ``--overlap-grad-reduce`` overlaps it), the distributed optimizer's parameter all-gather,
the gradient norm (every step: one read of the fp32 gradients of its shard, 4 bytes per element)
and the optimizer's update (read and write of its fp32 state: 30 bytes per element of its shard,
as one fused kernel).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mega.core.config.sections import RunConfig
from mega.core.plan.calibration import Rates
from mega.core.plan.shadow import RankProfile, profile_rank
from mega.core.plan.tracking import Work
from mega.core.plugins.manager import Plugins
from mega.errors import MegaUsageError
from mega.parallel.pipeline.simulator import simulate

# fp32 master, first and second moments read and written, the fp32 gradient read, the bf16
# parameter written (mega.parallel.data.optimizer's fused update)
OPTIMIZER_BYTES_PER_ELEMENT = 3 * 4 * 2 + 4 + 2
# the global gradient norm before the update (mega.parallel.data.optimizer, clipping or not):
# torch's foreach norm reads the shard's fp32 gradients once (on one H100 the 1.9B MoE's
# LpNorm kernels took 2.89 ms a step: 4 bytes x 1.94e9 at the calibrated 2.88 TB/s is 2.70)
GRAD_NORM_BYTES_PER_ELEMENT = 4
# bytes each rank sends per byte of the full tensor (ring algorithms, n ranks)
_BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,  # a point-to-point send: its bytes, once
    "sendrecv_exposed": lambda n: 1.0,
}
# The ring attention's transfers (``--cp-comm-type p2p``, mega.parallel.context.ring): every
# step posts the next block of keys and values (and in backward the previous block's gradient
# accumulator) before its attention kernel and waits after it, so a step takes the longer of
# the two. Summed over a layer's steps, all of equal size: the longer of the ring's attention
# and its transfers. A transfer with no kernel between its post and its wait (backward's last
# accumulator, on its way to its owner after the last step) is ``sendrecv_exposed``, counted in
# full with the other collectives.
_RING = ("cp", "sendrecv")
_POINT_TO_POINT = ("sendrecv", "sendrecv_exposed")


@dataclass
class StagePlan:
    """One pipeline stage's rank position."""

    stage: int
    profile: RankProfile
    forward_seconds: float  # per micro-batch, all of the rank's chunks
    backward_seconds: float


@dataclass
class Plan:
    """Memory of each stage and the step's time, for one layout."""

    stages: list[StagePlan]
    rates: Rates
    pipeline_seconds: float  # forward and backward of every micro-batch, with the bubble
    bubble: float  # idle share of the pipeline's time (0 without pipelining)
    gradient_sync_seconds: float  # exposed data-parallel reduction and parameter gather
    optimizer_seconds: float
    step_seconds: float
    tokens_per_second: float
    assumptions: tuple[str, ...] = ()  # what the count takes as given (a line each)

    @property
    def peak_bytes(self) -> int:
        """The largest stage's peak."""
        return max(s.profile.peak_bytes for s in self.stages)


def collective_seconds(work: Work, rates: Rates, dims: set[str]) -> float:
    """Time of ``work``'s collectives over the topology dimensions ``dims``: each one's bus
    bytes at the all-reduce bus rate (a point-to-point send's bytes at the point-to-point rate),
    plus the collective latency per launch."""
    if not rates.allreduce_bus_bytes:
        return 0.0
    total = 0.0
    for (dim, kind, size), payload in work.collectives.items():
        if dim in dims and size > 1 and (dim, kind) != _RING:
            rate = rates.p2p_rate if kind in _POINT_TO_POINT else rates.allreduce_bus_bytes
            total += payload * _BUS_FACTOR[kind](size) / rate
            total += work.launches[dim, kind, size] * rates.collective_latency_seconds
    return total


_LAYER_DIMS = {"tp", "cp", "tpcp", "ep"}  # collectives inside the layers
_STEP_DIMS = {"dp", "edp", "dpcp", "edpcp", "embd"}  # once per global batch


def ring_seconds(work: Work, rates: Rates) -> float:
    """Time of ``work``'s ring-attention transfers alone (see ``_RING``): their bytes at the
    point-to-point rate, plus the collective latency per transfer."""
    if not rates.allreduce_bus_bytes:
        return 0.0
    ring = [key for key in work.collectives if key[:2] == _RING]
    sent = sum(work.collectives[key] for key in ring)
    launches = sum(work.launches[key] for key in ring)
    return sent / rates.p2p_rate + launches * rates.collective_latency_seconds


def beside_seconds(work: Work, rates: Rates) -> float:
    """What ``work``'s transfers beside GEMMs (``Work.beside``) add to its GPU time: each pass's
    copy-engine transfer beyond the GEMM that ran beside it (:meth:`Rates.copy_engine_seconds`)."""
    total = 0.0
    for (sent, copies, flops), passes in work.beside.items():
        shown = rates.copy_engine_seconds(sent, copies) - flops / rates.matmul_flops
        total += passes * max(0.0, shown)
    return total


def work_seconds(work: Work, rates: Rates, attention_rate: float) -> float:
    """A stretch of ops: GPU time (compute, memory, in-layer collectives) or host launch time,
    whichever is longer."""
    gpu = (
        work.matmul_flops / rates.matmul_flops
        + (work.fp8_matmul_flops / rates.fp8_matmul_flops if work.fp8_matmul_flops else 0.0)
        + max(work.attention_flops / attention_rate, ring_seconds(work, rates))
        + work.memory_bytes / rates.memory_bytes
        + collective_seconds(work, rates, _LAYER_DIMS)
        + beside_seconds(work, rates)
    )
    return max(gpu, rates.host_seconds(work.ops, work.compiled_ops))


def plan_run(config: RunConfig, plugins: Plugins, rates: Rates) -> Plan:
    """Count every pipeline stage of ``config``'s layout and estimate its step (see above)."""
    if config.precision.fp8_format and not rates.fp8_matmul_flops:
        raise MegaUsageError(
            f"--fp8-format: the rates of {rates.gpu} ({rates.source}) have no FP8 GEMM rate;"
            " run `mega plan --calibrate` on that GPU again"
        )
    if config.training.cuda_graph_impl != "none":
        # a replayed graph launches its kernels in one call, without inductor's code or
        # dynamo's guards per kernel: its host time (not measured) is counted at an eager op's
        # cost per kernel, as before the compiled rate was measured (the graphed 2-H200 rows
        # planned within 15% that way, tests/test_plan_cuda_graphs_h200.py)
        rates = dataclasses.replace(rates, compiled_op_host_seconds=0.0)
    world = config.world_size
    pp = config.parallel.pipeline_model_parallel_size
    attention = rates.attention_rates(config.training.seq_length)
    stages = []
    for stage in range(pp):
        profile = profile_rank(config, plugins, stage * (world // pp))
        stages.append(
            StagePlan(
                stage,
                profile,
                work_seconds(profile.forward, rates, attention[0]),
                work_seconds(profile.backward, rates, attention[1]),
            )
        )
    m = config.num_microbatches
    slowest = max(stages, key=lambda s: s.forward_seconds + s.backward_seconds)
    bubble = 0.0
    if pp == 1:
        pipeline = m * (slowest.forward_seconds + slowest.backward_seconds)
    else:
        chunks = slowest.profile.chunks
        result = simulate(
            slowest.profile.table(pp, chunks, m),
            pp,
            chunks,
            m,
            forward_cost=slowest.forward_seconds / chunks,
            backward_cost=slowest.backward_seconds / chunks,
            p2p="rendezvous",
        )
        pipeline, bubble = result.total_time, result.bubble_fraction
    # the gradient reduction, launched by backward's hooks or at the step; under
    # --overlap-grad-reduce it runs beside the last micro-batch's backward, and what is longer
    # shows (the buckets' scaling, on the compute stream, does not overlap). The distributed
    # optimizer's parameter all-gather follows the update.
    hooked = slowest.profile.reduction
    reduce = collective_seconds(hooked, rates, _STEP_DIMS)
    if config.parallel.overlap_grad_reduce:
        reduce = max(0.0, reduce - slowest.backward_seconds)
    reduce += hooked.memory_bytes / rates.memory_bytes
    reduce += collective_seconds(slowest.profile.step, rates, _STEP_DIMS)
    optimizer = (
        slowest.profile.optimizer_elements
        * (GRAD_NORM_BYTES_PER_ELEMENT + OPTIMIZER_BYTES_PER_ELEMENT)
        / rates.memory_bytes
    )
    step = pipeline + reduce + optimizer
    tokens = config.global_batch_size * config.training.seq_length  # the default's when unset
    assumptions = ()
    experts = getattr(config.model, "num_experts", None)
    if experts:
        assumptions = (moe_assumption(config), MOE_HOST_GAPS)
    return Plan(
        stages=stages,
        rates=rates,
        pipeline_seconds=pipeline,
        bubble=bubble,
        gradient_sync_seconds=reduce,
        optimizer_seconds=optimizer,
        step_seconds=step,
        tokens_per_second=tokens / step,
        assumptions=assumptions,
    )


# What the step time leaves out that weighs on MoE steps (sessions 63-64's profiles, docs/plan.md):
# the GPU idles where the host has no lead (runs of the routing's short kernels, the step after a
# sync), which the larger-of-host-and-GPU per pass does not see: ~3% of a MoE DP2 rank's step on
# one H200 with no sync in it, 1.3 ms more for one iteration line a step (its syncs, the only
# ones). And the rates are one GPU's: the same rank's GEMMs ran 7% slower on another H200.
MOE_HOST_GAPS = (
    "not counted: the GPU's waits for the host inside a forward or backward pass (its routing"
    " launches runs of short kernels; a few percent of a MoE step), and GPUs of one kind whose"
    " kernels run slower than the calibrated one's; MoE steps have run 10-30% longer than planned"
    " on H200s (docs/plan.md)"
)


def moe_assumption(config: RunConfig) -> str:
    """The routing a MoE run is counted with (mega.core.plan.shadow): balanced."""
    model = config.model
    experts, k = model.num_experts, model.moe_router_topk
    ep = config.parallel.expert_model_parallel_size
    line = (
        f"MoE routing assumed balanced: each token's {k} slots spread evenly over the"
        f" {experts} experts"
    )
    if model.moe_expert_capacity_factor is not None:
        line += f", each keeping at most {model.moe_expert_capacity_factor:g} x its share"
    if ep > 1:
        line += f", every rank sending each of its {ep - 1} expert-parallel peers its share"
    return line + "; a skewed routing needs more memory and time than planned"
