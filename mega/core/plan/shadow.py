"""Build one rank's part of a run on the meta device and run a training step on it, counting.

The planner does not model mega: it runs it. Under torch's ``fake`` process-group backend (every
collective returns at once, nothing is sent) a rank position of the real layout is built with
the same code as ``mega train`` (``build_parts``: the model plugin, tensor/sequence/pipeline/
expert/context parallelism, recompute, the gradient buffer and the optimizer), on the meta device
(shapes, no data). One global batch then goes through the real executor and schedule table, and
the optimizer steps, under ``StepTracker``: the peak of the live bytes is the rank's peak memory,
and the ops seen are its work. Four things differ from a GPU, on purpose:

- attention is ``flash_attention`` (what a fused kernel keeps), not SDPA's math path on meta;
  so is each block of context-parallel attention (the ring's one call per step, the all-gather
  type's blocks), which on meta would take the float32 math path; the ring's merge is counted
  as the GPU's one Triton pass;
- point-to-point transfers send nothing: a pipeline stage's are skipped (the received buffers
  are allocated by the executor as on a GPU), the ring attention's are counted (their bytes,
  hidden behind the ring's kernels where one ran between post and wait: estimate's ``_RING``);
- nothing is compiled: the units ``mega train`` would compile on a GPU (its layers and head)
  run eagerly but are counted as their compiled selves keep memory (``mega.core.plan.compiled``)
  and as their fused graphs move bytes and launch kernels, plus what runs inside their opaque
  custom ops (the ring attention's merges and gradient accumulators, the weight gradient's
  GEMM), which inductor leaves unfused;
- a mixture-of-experts layer's routing has no values on meta, so it is counted as **balanced**:
  each rank's ``T * k`` (token, expert) slots spread evenly over the ``E`` experts, at most the
  capacity each (``--moe-expert-capacity-factor``), every rank sending each expert-parallel peer
  its share (``mega.parallel.expert.local.balanced_rows``). The router, the experts' GEMMs
  (grouped or one per expert, as the run has them), the dispatcher's gathers and all-to-alls
  run as on a GPU on those shapes. A skewed routing sends some experts more rows: its peak and
  its slowest expert's time are above the plan's (the router's load-balancing loss is what
  keeps it near balanced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mega.core.config.sections import RunConfig
from mega.core.plan.compiled import stand_in_compiled
from mega.core.plan.copy_engine import planned_copy_engine
from mega.core.plan.tracking import (
    StepTracker,
    Work,
    nbytes,
    planning_block_backward,
    planning_block_forward,
    planning_merge_into,
    planning_sdpa,
)
from mega.core.plan.tracking import send as plan_send
from mega.core.plugins.manager import Plugins
from mega.core.plugins.specs import BuildContext
from mega.core.training.batches import global_batch
from mega.core.training.build import (
    build_context,
    build_data,
    build_parts,
    compiles_layers,
    microbatch_preparation,
)
from mega.core.training.compile import compiled_units
from mega.core.training.step import model_forward
from mega.errors import MegaUsageError
from mega.parallel import comm
from mega.parallel.context import gather, ring
from mega.parallel.expert.aux_loss import private_scale
from mega.parallel.expert.validate import set_graphed_trips
from mega.parallel.pipeline.actions import Backward, Forward, WeightGrad
from mega.parallel.pipeline.simulator import simulate
from mega.parallel.topology import ORDER, Topology, build_topology
from mega.parallel.weight_grad import OpaqueWhenTraced, traced

META = torch.device("meta")
CUDA = torch.device("cuda")  # what a plan is for: whether the run compiles is decided for a GPU


@dataclass
class RankProfile:
    """One rank position's step, as counted on the meta device."""

    rank: int
    static_bytes: int  # parameters, gradient buffer and optimizer state, before the step
    state_bytes: dict[str, int]  # of those: "parameters", "gradients", "optimizer"
    peak_bytes: int  # the largest live total during forward, backward and the optimizer step
    forward: Work  # per micro-batch, over this rank's chunks
    backward: Work  # per micro-batch (recompute's forwards included)
    reduction: Work  # the gradient buckets backward's hooks reduce, once per global batch
    step: Work  # the rest of the gradient reduction and the optimizer, once per global batch
    chunks: int
    optimizer_elements: int  # the fp32 elements this rank's optimizer updates (its shard)
    parameters: int  # elements of the parameters this rank holds (its chunks', tied ones once)
    table: Any  # the schedule's table function (pp, vpp, m) -> actions by pipeline rank


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which this process is ``rank`` and no
    collective moves anything (torch's ``fake`` backend)."""
    if dist.is_initialized():
        raise RuntimeError("planning needs a process without a process group")
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def planning_patches() -> Iterator[None]:
    """Attention that keeps what a fused kernel keeps (SDPA and context parallelism's blocks);
    the ring's merge as the GPU's one pass; point-to-point transfers that send nothing (the
    ring's counted); opaque custom ops' bodies counted as unfused (``StepTracker.opaque``); the
    MoE auxiliary losses' scale of the planner's own; the TP copy-engine split's transfers
    beside their GEMMs (:mod:`mega.core.plan.copy_engine`)."""
    sdpa, exchange, merge = F.scaled_dot_product_attention, comm.exchange, ring.merge_into
    opaque_call = OpaqueWhenTraced.__call__
    blocks = [(module, module.block_forward, module.block_backward) for module in (ring, gather)]
    calls = [0]  # the context-parallel blocks' kernel calls so far

    def block_forward(*args: Any) -> Any:
        calls[0] += 1
        return planning_block_forward(*args)

    def block_backward(*args: Any) -> Any:
        calls[0] += 1
        return planning_block_backward(*args)

    class Posted(comm.PostedBatch):
        """A batch posted without waiting: its sends counted at its wait, as hidden behind the
        attention where a block's kernel was called in between (the ring's), else exposed."""

        def __init__(self, sends: list, group: Any) -> None:
            super().__init__([])
            # what a send is counted by, not the tensor: holding it would keep it live
            self.sends = [(tensor.new_empty(0), nbytes(tensor)) for tensor, _ in sends]
            self.group, self.posted_at = group, calls[0]

        def wait(self) -> None:
            sends, self.sends = self.sends, []
            for anchor, size in sends:
                plan_send(anchor, size, self.group.group_name, calls[0] > self.posted_at)

    def no_transfer(sends: Any, recvs: Any, group: Any, wait: bool = True) -> Any:
        # counted (the ring's; a pipeline's are the simulator's), not sent
        sends = list(sends) if group is not None else []
        if not wait:
            return Posted(sends, group)
        for tensor, _ in sends:
            plan_send(tensor, nbytes(tensor), group.group_name, False)
        return None

    def observed_call(self: OpaqueWhenTraced, *args: Any) -> Any:
        mode = _get_current_dispatch_mode()
        if traced() or not isinstance(mode, StepTracker):
            return opaque_call(self, *args)
        with mode.opaque():
            return self.body(*args)

    F.scaled_dot_product_attention, comm.exchange = planning_sdpa, no_transfer
    ring.merge_into, OpaqueWhenTraced.__call__ = planning_merge_into, observed_call
    for module, _, _ in blocks:
        module.block_forward, module.block_backward = block_forward, block_backward
    try:
        with private_scale(), planned_copy_engine():
            yield
    finally:
        F.scaled_dot_product_attention, comm.exchange = sdpa, exchange
        ring.merge_into, OpaqueWhenTraced.__call__ = merge, opaque_call
        for module, forward, backward in blocks:
            module.block_forward, module.block_backward = forward, backward


def planning_microbatch(
    config: RunConfig, plugins: Plugins, ctx: BuildContext, topology: Topology
) -> dict:
    """One micro-batch of the run's shapes, on the meta device. A dataset that gives language-
    model samples (the mock one's keys) is replaced by the mock one: the plan needs no data files."""
    mock = plugins.datasets.get("mock") if "mock" in plugins.datasets else None
    if mock is not None and plugins.datasets.get(config.dataset_name).provides == mock.provides:
        config = dataclasses.replace(config, dataset_name="mock", dataset=mock.config_cls())
    # one global batch of samples is all the step reads
    training = dataclasses.replace(config.training, train_iters=1, train_samples=None, eval_iters=0)
    config = dataclasses.replace(config, training=training)
    splits = build_data(config, plugins, ctx)
    mbs = config.training.micro_batch_size
    model = plugins.models.get(config.model_name)
    prepare = microbatch_preparation(model.prepare_microbatch, topology)
    return global_batch(splits.train, 0, mbs, mbs, META, prepare=prepare)[0]


# what compiled units keep, by kind of unit (code and shapes): measured once per process
_COMPILED: dict = {}


def _stand_in_compiled_units(
    config: RunConfig, plugins: Plugins, chunks: list[torch.nn.Module], tracker: StepTracker
) -> None:
    """The units ``--compile`` compiles keep for backward what their compiled selves keep."""
    spec = plugins.models.get(config.model_name)
    plan = spec.parallel_plan(config.model) if spec.parallel_plan else None
    if plan is None or not plan.layers:
        return  # a model compiled whole: counted eager
    units = {id(unit): unit for chunk in chunks for unit in compiled_units(chunk, plan)}
    for unit in units.values():
        stand_in_compiled(unit, tracker, _COMPILED)


def _state_bytes(parts: Any) -> dict[str, int]:
    return {
        "parameters": nbytes(parts.buffer.param_data),
        "gradients": nbytes(parts.buffer.main_grad),
        "optimizer": parts.optimizer.state_bytes(),  # fp32 runs keep no master copy
    }


def _in_flight(table: dict[int, list[Any]]) -> tuple:
    """The most micro-batches each rank holds activations for at once, in all and by chunk: a
    forward holds them until its backward, or its weight gradients where the table splits them
    off."""
    shape = []
    for rank in sorted(table):
        actions = table[rank]
        split = {(a.microbatch, a.chunk) for a in actions if isinstance(a, WeightGrad)}
        live: dict[int, int] = {}
        most_by_chunk: dict[int, int] = {}
        most = 0
        for a in actions:
            if isinstance(a, Forward):
                live[a.chunk] = live.get(a.chunk, 0) + 1
                most_by_chunk[a.chunk] = max(most_by_chunk.get(a.chunk, 0), live[a.chunk])
                most = max(most, sum(live.values()))
            elif isinstance(a, WeightGrad) or (
                isinstance(a, Backward) and (a.microbatch, a.chunk) not in split
            ):
                live[a.chunk] -= 1
        shape.append((most, tuple(sorted(most_by_chunk.items()))))
    return tuple(shape)


def counted_microbatches(table: Callable[[int, int, int], Any], pp: int, vpp: int, m: int) -> int:
    """How many of a step's ``m`` micro-batches the count runs: the fewest whose schedule holds
    as many in flight on every rank and chunk as ``m`` do. The peak is the same (one GPU with
    any ``m``: one), the work per micro-batch too, and a plan no longer grows with the global
    batch (128 micro-batches took as long to count as 128 steps of one)."""
    try:
        full = _in_flight(table(pp, vpp, m))
    except Exception:  # noqa: BLE001 - a schedule that cannot tell: count them all
        return m
    for fewer in range(1, m):
        try:
            candidate = table(pp, vpp, fewer)
            simulate(candidate, pp, vpp, fewer, p2p="rendezvous")  # as the executor checks
        except Exception:  # noqa: BLE001 - too few for this schedule (or it cannot run them)
            continue
        if _in_flight(candidate) == full:
            return fewer
    return m


@contextlib.contextmanager
def _on_meta(model: str, what: str) -> Iterator[None]:
    """A model that cannot ``what`` on the meta device (a plugin's forward that reads a tensor's
    values on the host, say) cannot be planned: one line saying so and where, not a traceback."""
    try:
        yield
    except MegaUsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the model did is what the line says
        planner = str(Path(__file__).parent)  # its dispatch mode is where a failing op surfaces
        frames = [
            f
            for f in traceback.extract_tb(exc.__traceback__)
            if "/torch/" not in f.filename and not f.filename.startswith(planner)
        ]
        where = f", at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise MegaUsageError(
            f"model '{model}' cannot be planned: it does not {what} on the meta device, where"
            f" mega plan counts it ({type(exc).__name__}: {str(exc).splitlines()[0]}{where})"
        ) from None


def profile_rank(config: RunConfig, plugins: Plugins, rank: int) -> RankProfile:
    """Build rank ``rank`` of ``config``'s layout on the meta device and count one eager step."""
    graphed = set_graphed_trips(False)  # the build sets it for the counted GPU run
    try:
        return _profile_rank(config, plugins, rank)
    finally:
        set_graphed_trips(graphed)  # and the process gets back what it had


def _profile_rank(config: RunConfig, plugins: Plugins, rank: int) -> RankProfile:
    world = config.world_size
    with fake_world(world, rank), planning_patches():
        topology = build_topology(world, rank, **config.parallel.sizes())
        # a group serving two dimensions (tp and tpcp without context parallelism) is named
        # by its plain one
        plain = sorted(topology.groups.items(), key=lambda item: item[0] in ORDER)
        names = {group.group_name: name for name, group in plain}
        tracker = StepTracker(names)
        with tracker, _on_meta(config.model_name, "build"):
            ctx = build_context(config, plugins, topology, META)
            parts = build_parts(config, plugins, topology, META, ctx, None)
            if compiles_layers(config.training.compile, CUDA):
                _stand_in_compiled_units(config, plugins, parts.executor.chunks, tracker)
        microbatch = planning_microbatch(config, plugins, ctx, topology)
        m = config.num_microbatches
        forward = Work()
        executor = parts.executor

        def counted_forward(model: Any, mb: dict, hidden: Any = None) -> Any:
            # a forward's ops go to ``forward``; everything else of the passes is backward
            # (recompute's forwards included)
            outer, tracker.work = tracker.work, forward
            try:
                return model_forward(model, mb, hidden)
            finally:
                tracker.work = outer

        executor.forward_fn = counted_forward
        reduction = Work()
        start_bucket = parts.buffer._start

        def counted_start(bucket: Any, async_op: bool) -> None:
            # a bucket's reduction, started by the last micro-batch's backward: once per step
            outer, tracker.work = tracker.work, reduction
            try:
                start_bucket(bucket, async_op)
            finally:
                tracker.work = outer

        parts.buffer._start = counted_start
        update = parts.optimizer._update

        def compiled_update(*args: Any, **kwargs: Any) -> Any:
            # on a GPU the update is one compiled kernel writing the state in place: none of
            # the eager update's temporaries (28 bytes per element) exist there
            with tracker.memory_uncounted():
                return update(*args, **kwargs)

        parts.optimizer._update = compiled_update
        m = counted_microbatches(executor.table, executor.layout.pp, executor.layout.vpp, m)
        with tracker, _on_meta(config.model_name, "run its step"):
            tracker.work = Work()
            static = tracker.live
            tracker.reset_peak()
            parts.buffer.start_step(m)
            executor.forward_backward([dict(microbatch) for _ in range(m)])
            backward = tracker.work
            tracker.work = Work()
            parts.buffer.finish_grad_sync()
            parts.optimizer.step(config.optimizer.lr, 1)
            step = tracker.work
        return RankProfile(
            rank=rank,
            static_bytes=static,
            state_bytes=_state_bytes(parts),
            peak_bytes=tracker.peak,
            forward=forward.scaled(1 / m),
            backward=backward.scaled(1 / m),
            reduction=reduction,
            step=step,
            chunks=len(executor.chunks),
            optimizer_elements=parts.optimizer.elements,
            parameters=sum(
                p.numel()
                for p in {id(p): p for c in executor.chunks for p in c.parameters()}.values()
            ),
            table=executor.table,
        )
