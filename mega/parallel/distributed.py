"""Where this process sits in the job, read from the launcher's environment, and process-group setup.

Three ways a process learns its rank, in this order:
- torchrun / torch elastic (and ``mega train --nproc-per-node``): RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT;
- SLURM (``srun mega train ...``, one task per GPU): SLURM_PROCID, SLURM_STEP_NUM_TASKS (the
  srun step's size; an sbatch script without srun is not a worker), SLURM_LOCALID;
  the master is the first host of SLURM_JOB_NODELIST, the port MASTER_PORT or one derived from
  the job id, so every task of a job agrees without talking;
- nothing set: a one-process run.

Reading the environment needs no torch, so ``resolve_config`` can validate a layout before launch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class ProcessPlace:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"  # "torchrun", "slurm" or "single"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read SLURM_JOB_NODELIST '{nodelist}'")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]  # keeps zero padding: [07-09] -> 07
    return prefix + first


def process_place(env: Mapping[str, str] | None = None) -> ProcessPlace:
    """This process's place in the job, from torchrun's or SLURM's variables."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessPlace(
            world_size=int(env["WORLD_SIZE"]),
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="torchrun",
        )
    # SLURM_STEP_NUM_TASKS is set by srun for its job step. The batch script itself also has
    # SLURM_PROCID=0 and SLURM_NTASKS=N, but it is not a worker: it must run (or launch) alone.
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        return ProcessPlace(
            world_size=int(env["SLURM_STEP_NUM_TASKS"]),
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "")),
            # the same port for every task of the job, and different jobs rarely collide
            master_port=int(env.get("MASTER_PORT") or 20000 + job % 20000),
            source="slurm",
        )
    return ProcessPlace()


def init_process_group(place: ProcessPlace, backend: str, timeout_minutes: float) -> None:
    """Join the job's default process group; collectives then fail after ``timeout_minutes``."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # NVLink SHARP (multicast) stays off: it is not available on every machine we run on, and a
    # rank that tries it where it is missing hangs instead of failing.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        import torch

        kwargs["device_id"] = torch.device("cuda", place.local_rank)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{url_host(place.master_addr)}:{place.master_port}",
        world_size=place.world_size,
        rank=place.rank,
        timeout=timedelta(minutes=timeout_minutes),
        **kwargs,
    )


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def join_job(config: Any, joins: dict[str, tuple[str, ...]] | None = None) -> tuple[Any, Any]:
    """Pick this process's device, join the job's process group (several processes) and build
    its topology; returns ``(torch.device, Topology)``. ``joins``: the derived groups each of
    the run's plugin dimensions (``--extra-parallel-size``) joins."""
    import torch

    from mega.errors import MegaUsageError
    from mega.parallel.topology import build_topology

    place = process_place()
    if place.world_size != config.world_size:
        raise MegaUsageError(
            f"this job has {place.world_size} processes but the config was validated for "
            f"{config.world_size}"
        )
    wanted = config.training.device
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if wanted == "auto" else wanted
    device = torch.device(kind)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", place.local_rank)  # one GPU per local rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel = config.parallel
    if place.world_size > 1:
        backend = parallel.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
        init_process_group(place, backend, parallel.distributed_timeout_minutes)
    topology = build_topology(
        place.world_size,
        place.rank,
        local_rank=place.local_rank,
        high_priority=parallel.high_priority_stream_groups,
        extra=parallel.extra_sizes(),
        joins=joins,
        **parallel.sizes(),
    )
    return device, topology


def finish_job() -> None:
    """After a run that ended normally: free, on every rank at once, what is freed collectively
    (the flex MoE dispatcher's NVSHMEM buffers, :mod:`mega.parallel.expert.split_exchange`),
    while every rank is still here, and the CUDA graphs that captured NCCL kernels (the CP ring's,
    :func:`mega.parallel.context.graphed.release_graphs`), which the process group's destroy
    would wait for, and likewise the compiled layers' graphs (``--cuda-graph-impl local``,
    inductor's graph trees: a TP2 run on 2 H200 trained and then hung at exit until they were
    destroyed here). Not after an error: a collective free would wait for ranks that left, and a
    replay may wait for one (after an error the launcher stops the ranks)."""
    import sys

    graphed = sys.modules.get("mega.parallel.context.graphed")
    if graphed is not None:  # NCCL's destroy (leave_job) waits for the graphs holding its kernels
        graphed.release_graphs()
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is not None and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.synchronize()  # no replay still running on what is destroyed
        trees.reset_cudagraph_trees()
    validate = sys.modules.get("mega.parallel.expert.validate")
    if validate is not None:  # the run's choice of MoE trips ends with it
        validate.set_graphed_trips(False)
    exchange = sys.modules.get("mega.parallel.expert.split_exchange")
    if exchange is not None and exchange.holds_buffers():
        exchange.release_buffers()
        sys.modules["torch.distributed"].barrier()


def leave_job() -> None:
    """Destroy this process's process group, if it joined one, before the interpreter exits.

    Left alive, gloo's (and NCCL's) background threads are torn down by the C++ runtime at exit,
    which aborts the process now and then ("terminate called without an active exception",
    SIGABRT: 2 failures in 14 runs of tests/test_launch.py; 0 in 10 once destroyed and
    collected). Destroying the group is local, not a collective, so it is safe after an error.
    """
    import gc
    import sys

    dist = sys.modules.get("torch.distributed")  # never imported just for this
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # The finished engine still holds its groups (topology, gradient-hook cycles): free them
        # now, while their threads can still be joined, not during interpreter teardown.
        gc.collect()


# how long a symmetric-memory signal waits for its peer before trapping: the default NCCL timeout
# (a peer still compiling is not a dead peer)
SIGNAL_TIMEOUT_MS = 600_000


def peer_copies_possible(group: Any, like: Any) -> bool:
    """Whether tensors like ``like`` can be copied into the symmetric memory of ``group``'s
    ranks by the copy engine: CUDA tensors, an NCCL group, every rank on this host."""
    import torch.distributed as dist

    return like.is_cuda and dist.get_backend(group) == "nccl" and one_host(group)


def one_host(group: Any) -> bool:
    """Whether every member of ``group`` runs on this host (peer-mapped memory needs it). torch's
    launcher numbers ranks host by host, ``LOCAL_WORLD_SIZE`` to a host."""
    import torch.distributed as dist

    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if per_host <= 0:
        return False
    hosts = {rank // per_host for rank in dist.get_process_group_ranks(group)}
    return len(hosts) == 1
