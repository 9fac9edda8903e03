"""Build one rank's part of a run on the meta device and run a training step on it, counting.

The planner does not model mega: it runs it. Under torch's ``fake`` process-group backend (every
collective returns at once, nothing is sent) a rank position of the real layout is built with
the same code as ``mega train`` (``build_parts``: the model plugin, tensor/sequence/pipeline/
expert/context parallelism, recompute, the gradient buffer and the optimizer), on the meta device
(shapes, no data). One global batch then goes through the real executor and schedule table, and
the optimizer steps, under ``StepTracker``: the peak of the live bytes is the rank's peak memory,
and the ops seen are its work. Three things differ from a GPU, on purpose:

- attention is ``flash_attention`` (what a fused kernel keeps), not SDPA's math path on meta;
- point-to-point transfers between pipeline stages are skipped (the received buffers are
  allocated by the executor as on a GPU);
- nothing is compiled: the units ``mega train`` would compile on a GPU (its layers and head,
  without tensor or context parallelism) run eagerly but are counted as their compiled selves
  keep memory (``mega.core.plan.compiled``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega import BuildContext
from mega.core.config.sections import RunConfig
from mega.core.plan.compiled import stand_in_compiled
from mega.core.plan.tracking import StepTracker, Work, nbytes, planning_sdpa
from mega.core.plugins.manager import Plugins
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
from mega.parallel import comm
from mega.parallel.topology import ORDER, Topology, build_topology

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
    step: Work  # gradient reduction and the optimizer, once per global batch
    chunks: int
    optimizer_elements: int  # the fp32 elements this rank's optimizer updates (its shard)
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
    """Attention that keeps what a fused kernel keeps; pipeline transfers that send nothing."""
    sdpa, exchange = F.scaled_dot_product_attention, comm.exchange

    def no_transfer(sends: Any, recvs: Any, group: Any, wait: bool = True) -> Any:
        return None if wait else comm.PostedBatch([])

    F.scaled_dot_product_attention, comm.exchange = planning_sdpa, no_transfer
    try:
        yield
    finally:
        F.scaled_dot_product_attention, comm.exchange = sdpa, exchange


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
    optimizer = parts.optimizer
    return {
        "parameters": nbytes(parts.buffer.param_data),
        "gradients": nbytes(parts.buffer.main_grad),
        "optimizer": sum(
            nbytes(t)
            for t in (optimizer.master, optimizer.exp_avg, optimizer.exp_avg_sq)
            if t is not None  # fp32 runs keep no master copy
        ),
    }


def profile_rank(config: RunConfig, plugins: Plugins, rank: int) -> RankProfile:
    """Build rank ``rank`` of ``config``'s layout on the meta device and count one eager step."""
    world = config.world_size
    with fake_world(world, rank), planning_patches():
        topology = build_topology(world, rank, **config.parallel.sizes())
        # a group serving two dimensions (tp and tpcp without context parallelism) is named
        # by its plain one
        plain = sorted(topology.groups.items(), key=lambda item: item[0] in ORDER)
        names = {group.group_name: name for name, group in plain}
        tracker = StepTracker(names)
        with tracker:
            ctx = build_context(config, plugins, topology, META)
            parts = build_parts(config, plugins, topology, META, ctx, None)
            if compiles_layers(config.training.compile, CUDA, topology):
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
        with tracker:
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
            step=step,
            chunks=len(executor.chunks),
            optimizer_elements=parts.optimizer.exp_avg.numel(),
            table=executor.table,
        )
