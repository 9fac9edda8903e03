"""Contiguous parameter and fp32 gradient buffers, reduced over data-parallel ranks in buckets.

Megatron's ``param_and_grad_buffer``, simplified. Every trainable parameter becomes a view into one
flat buffer of the model's dtype (``param_data``) and gets a ``main_grad`` view into one flat fp32
buffer. Parameters are laid out in reverse order, the order backward produces their gradients, and
cut into buckets of about ``bucket_size`` elements; inside a bucket the matrices come before the
vectors, so that the optimizer updates each bucket in two runs, one with weight decay and one
without (:mod:`mega.parallel.data.optimizer`). A post-accumulate hook adds each micro-batch's
low-precision ``.grad`` into ``main_grad`` (fp32 accumulation) and frees it; the first gradient of
a step is copied rather than added, so the buffer is never zeroed between steps. Linear weights
under gradient accumulation fusion (:mod:`mega.parallel.weight_grad`) write ``main_grad`` themselves, inside
their weight-gradient GEMM, and the hook only counts them.

Under CUDA graphs (``graph_safe``, ``--cuda-graph-impl local``) a replayed backward runs the
weight-gradient GEMM as captured and none of the Python around it: it cannot choose between
overwriting and adding per micro-batch, nor set the flag that tells the hook the gradient is
written. So the buffer zeroes those weights' ``main_grad`` at the start of each step, their
GEMMs always add, and the flag set at capture stays set (Megatron zeroes its buffers every step
too). The gradients that reach ``main_grad`` through the hook (the MoE experts', norms',
embeddings') run eagerly after the graphed backward, so they keep the copy of the first
micro-batch: a parameter is treated so once its hook has accumulated a gradient and it has
never been written by a GEMM (``_through_hook_only``); until then (the first step, or a
parameter not yet seen) it is zeroed and added, which is right either way.

The data-parallel reduction of a bucket is a SUM of gradients pre-scaled by 1/DP (inside NCCL's
kernel, its PREMUL_SUM; by a pass before it on gloo, which has none): an all-reduce, or with the
distributed optimizer a reduce-scatter that leaves each rank the reduced slice it owns
(``shard``). Dense buckets are reduced over ``dpcp``, the data-parallel
ranks and their context-parallel ones: a context-parallel rank's loss is its share of the
micro-batch's loss (:mod:`mega.parallel.context`), so its gradients are summed, not averaged,
and the distributed optimizer shards over all of them. With ``overlap`` the reduction of a bucket starts, async, as
soon as backward has produced all its gradients for the last micro-batch; buckets always start in
index order, so every rank issues the same collectives in the same order.

Expert weights (``param.expert_parallel``: each expert-parallel rank holds other experts) sit in
buckets of their own, after the dense ones, reduced over the expert-data-parallel group (``edpcp``:
the ranks holding the same experts, with their context-parallel ones) instead of ``dpcp``. Both kinds are pre-scaled by 1/DP, the
dense data-parallel size: an expert's gradient already holds the contributions of the tokens of
every expert-parallel rank, whose losses are averaged over all DP ranks (as Megatron scales).

Tied weights across pipeline stages (the word embeddings, used again by the last stage's output
layer) sit alone in a final bucket that never starts during backward: ``finish_grad_sync`` first
sums their gradients over the first and last stage (the ``embd`` group), then reduces the bucket
over DP. Both stages' tied buckets are laid out alike, so they shard alike under the distributed
optimizer and the two copies get the same update.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from mega.parallel import comm
from mega.parallel.data.accumulate import accumulate_into
from mega.parallel.topology import Topology
from mega.parallel.weight_grad import register_fused_weight

# Megatron's default: max(40M, 1M x DP) elements per bucket.
DEFAULT_BUCKET_ELEMENTS = 40_000_000
# Every parameter starts on a multiple of 64 elements (as in Megatron's buffer), and bucket ends
# are padded so each rank's shard does too (and splits evenly): cuBLAS reads a bias at a 4-byte
# offset (after BERT's binary-head bias of 2 elements) as a misaligned address on a GPU.
_ALIGN = 64


def _weak_hook(buffer: ParamAndGradBuffer) -> Any:
    """The buffer's gradient hook through a weak reference. A parameter's hooks live on its C++
    side, where Python's garbage collector cannot see the cycle parameter -> hook -> buffer ->
    parameter: a bound method there kept every finished run's parameters and gradients alive
    (on a GPU, gigabytes per engine in one process)."""
    ref = weakref.ref(buffer)

    def hook(param: torch.nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._on_grad(param)

    return hook


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    start: int  # [start, end) in the flat buffers; end - start divisible by DP
    end: int
    waiting: int = 0  # gradients of this step's last micro-batch still to arrive
    tied: bool = False  # holds tied weights: reduced only after their cross-stage sum
    # the topology group it is reduced over: "dpcp" (data x context parallel) for dense weights,
    # "edpcp" (expert data x context parallel) for expert weights
    group: str = "dpcp"
    handle: Any = None  # the async collective in flight
    started: bool = False

    def shard(self, dp_rank: int, dp: int) -> tuple[int, int]:
        """The flat range this DP rank owns (distributed optimizer)."""
        size = (self.end - self.start) // dp
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


def _through_hook_only(param: torch.nn.Parameter) -> bool:
    """Whether ``param``'s gradients have reached ``main_grad`` through the hook and never by a
    fused weight-gradient GEMM (module docstring: those need no zeroing under graphs)."""
    return getattr(param, "main_grad_by_hook", False) and not getattr(
        param, "main_grad_by_gemm", False
    )


@dataclass
class ParamAndGradBuffer:
    """See the module docstring. Build with ``ParamAndGradBuffer.build(...)``."""

    topology: Topology
    params: list[torch.nn.Parameter]
    ranges: dict[torch.nn.Parameter, tuple[int, int]]
    buckets: list[Bucket]
    param_data: torch.Tensor
    main_grad: torch.Tensor
    distributed: bool  # reduce-scatter (distributed optimizer) instead of all-reduce
    overlap: bool
    # CUDA graphs replay the fused weight-gradient GEMMs: zero at each step, always add (above)
    graph_safe: bool = False
    bucket_of: dict[torch.nn.Parameter, Bucket] = field(default_factory=dict)
    _expected: int = 1
    _counts: dict[torch.nn.Parameter, int] = field(default_factory=dict)
    _next: int = 0  # the next bucket to start

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        topology: Topology,
        *,
        bucket_size: int | None = None,
        overlap: bool = False,
        distributed: bool = False,
        tied: list[torch.nn.Parameter] | None = None,
        graph_safe: bool = False,
    ) -> ParamAndGradBuffer:
        """``tied``: parameters whose gradients are summed over the ``embd`` group first;
        ``graph_safe``: the step's backward may be CUDA-graph replays (module docstring)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of mixed dtypes {sorted(map(str, dtypes))}")
        dp = topology.data_parallel_size
        limit = bucket_size or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp)
        tied_ids = {id(p) for p in tied or ()}

        def kind(param: torch.nn.Parameter) -> int:  # 0 dense, 1 expert, 2 tied
            if id(param) in tied_ids:
                return 2
            return 1 if getattr(param, "expert_parallel", False) else 0

        # backward produces the last layers' gradients first; experts' buckets follow the dense
        # ones, and tied weights go last, alone
        ordered = sorted((p for _, p in reversed(named)), key=kind)
        groups: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for i, param in enumerate(ordered):
            groups[-1].append(param)
            size += param.numel()
            last = i == len(ordered) - 1
            if not last and (size >= limit or kind(ordered[i + 1]) != kind(param)):
                groups.append([])
                size = 0
        ranges: dict[torch.nn.Parameter, tuple[int, int]] = {}
        buckets: list[Bucket] = []
        offset = 0
        for members in groups:
            # Inside a bucket the order is free (it is ready when all of it is): matrices first,
            # then vectors, so that the optimizer sees one weight-decay run and one without.
            members = sorted(members, key=lambda p: p.ndim < 2)
            group = "edpcp" if kind(members[0]) == 1 else "dpcp"
            pad = _ALIGN * _group_size(topology, group)
            start = offset
            for param in members:
                offset = -(-offset // _ALIGN) * _ALIGN
                ranges[param] = (offset, offset + param.numel())
                offset += param.numel()
            offset = -(-offset // pad) * pad
            tied_bucket = kind(members[0]) == 2
            buckets.append(Bucket(members, start, offset, tied=tied_bucket, group=group))
        device, dtype = named[0][1].device, named[0][1].dtype
        param_data = torch.zeros(offset, dtype=dtype, device=device)
        main_grad = torch.zeros(offset, dtype=torch.float32, device=device)
        buffer = cls(
            topology=topology,
            params=[p for _, p in named],
            ranges=ranges,
            buckets=buckets,
            param_data=param_data,
            main_grad=main_grad,
            distributed=distributed,
            overlap=overlap,
            graph_safe=graph_safe,
        )
        with torch.no_grad():
            for param, (lo, hi) in ranges.items():
                view = param_data[lo:hi].view_as(param)
                view.copy_(param.data)
                param.data = view  # the parameter now lives in the flat buffer
                param.main_grad = main_grad[lo:hi].view_as(param)
                register_fused_weight(param)  # found by the fused linear's weight-gradient op
                hook = _weak_hook(buffer)
                param.register_post_accumulate_grad_hook(hook)
                # for gradients written outside autograd (deferred weight gradients, weight_grad.py)
                param.notify_main_grad = hook
        for bucket in buckets:
            for param in bucket.params:
                buffer.bucket_of[param] = bucket
        return buffer

    # ------------------------------------------------------------------ during backward

    def start_step(self, num_microbatches: int) -> None:
        """Before a step's backward passes: how many micro-batches each gradient arrives for."""
        self._expected = num_microbatches
        self._counts = dict.fromkeys(self.params, 0)
        self._next = 0
        for bucket in self.buckets:
            bucket.waiting, bucket.handle, bucket.started = len(bucket.params), None, False
        # a parameter's first gradient this step overwrites main_grad (no zeroing), except under
        # graphs where it may come from a captured GEMM, which always adds (module docstring)
        zeroed = []
        for param in self.params:
            param.main_grad_fresh = not self.graph_safe or _through_hook_only(param)
            if not param.main_grad_fresh:
                zeroed.append(param.main_grad)
        if len(zeroed) == len(self.params):  # the first graphed step: the whole buffer
            self.main_grad.zero_()
        elif zeroed:
            torch._foreach_zero_(zeroed)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if getattr(param, "wgrad_deferred", False):
            # a deferred weight gradient (mega.parallel.weight_grad): backward gave a placeholder, and
            # the queue that computes the gradient reports it later
            param.wgrad_deferred = False
            param.grad = None
            return
        added = getattr(param, "grad_added_to_main_grad", False)
        if param.grad is None and not added:  # autograd gave no gradient: nothing to count
            return
        if added:  # the fused wgrad GEMM wrote it; a replay would not set the flag again
            param.grad_added_to_main_grad = self.graph_safe
            param.main_grad_by_gemm = True
        else:  # the first micro-batch's is copied, the rest added, in fp32 (accumulate.py)
            accumulate_into(param.main_grad, param.grad, getattr(param, "main_grad_fresh", False))
            param.main_grad_by_hook = True
        param.main_grad_fresh = False
        param.grad = None
        if not self.overlap or not self._counts:
            return
        self._counts[param] += 1
        if self._counts[param] == self._expected:
            bucket = self.bucket_of[param]
            bucket.waiting -= 1
            # start every bucket whose turn has come and whose gradients are all final
            while (
                self._next < len(self.buckets)
                and self.buckets[self._next].waiting == 0
                and not self.buckets[self._next].tied  # waits for the cross-stage sum
            ):
                self._start(self.buckets[self._next], async_op=True)
                self._next += 1

    def _start(self, bucket: Bucket, async_op: bool) -> None:
        dp = self.topology.data_parallel_size
        bucket.started = True
        if dp * self.topology.context_parallel_size == 1:
            return
        grad = self.main_grad[bucket.start : bucket.end]
        group = self.topology.group(bucket.group)
        # dense and expert gradients alike are scaled by 1/DP (module docstring); summed over
        # context-parallel ranks, whose losses are shares of one loss (mega.parallel.context).
        # NCCL scales inside the reduction; gloo (and a group of one) before it.
        op = comm.premul_sum(1.0 / dp, group) if dp > 1 else None
        if dp > 1 and op is None:
            grad.mul_(1.0 / dp)
        if group is None:  # expert weights with one expert-data-parallel rank
            return
        if self.distributed:
            lo, hi = self.shard_of(bucket)
            bucket.handle = comm.reduce_scatter_into(
                self.main_grad[lo:hi], grad, group, async_op=async_op, op=op
            )
        else:
            bucket.handle = comm.all_reduce(grad, group, op=op, async_op=async_op)

    def finish_grad_sync(self) -> None:
        """After the last backward: every bucket reduced (started now if not yet), then the
        gradients that sequence parallelism left partial on each TP rank are summed over TP."""
        for param in self.params:
            if getattr(param, "main_grad_fresh", False):  # no gradient this step: it is zero
                param.main_grad.zero_()
                param.main_grad_fresh = False
        for bucket in self.buckets:
            if bucket.tied:
                self._sum_tied(bucket)
            if not bucket.started:
                self._start(bucket, async_op=False)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        self._counts = {}
        partial = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        tp_group = self.topology.group("tp")
        if partial and tp_group is not None:
            flat = torch.cat([p.main_grad.reshape(-1) for p in partial])
            comm.all_reduce(flat, tp_group)
            torch._foreach_copy_(
                [p.main_grad.reshape(-1) for p in partial],
                list(flat.split([p.numel() for p in partial])),
            )

    def _sum_tied(self, bucket: Bucket) -> None:
        """Add the other pipeline stage's gradients of the tied weights (before the DP reduce)."""
        comm.all_reduce(self.main_grad[bucket.start : bucket.end], self.topology.group("embd"))

    def zero_grad(self) -> None:
        """Zero every gradient. Training steps do not need it: each step's first gradient of a
        parameter overwrites its ``main_grad`` (see ``start_step``)."""
        self.main_grad.zero_()
        for param in self.params:
            param.grad = None
            param.main_grad_fresh = False

    # ------------------------------------------------------------------ after the step

    def shard_of(self, bucket: Bucket) -> tuple[int, int]:
        """The flat range of ``bucket`` this rank owns under the distributed optimizer."""
        group = bucket.group
        return bucket.shard(self.topology.group_rank(group), _group_size(self.topology, group))

    def owned_flat_ranges(self) -> list[tuple[int, int]]:
        """The flat ranges ``[lo, hi)`` of the buffers that this rank updates: all of them
        without the distributed optimizer; this rank's shard of each bucket with it."""
        if not self.distributed:
            return [(0, self.main_grad.numel())]
        return [self.shard_of(bucket) for bucket in self.buckets]

    def gather_params(self) -> None:
        """Distributed optimizer: every rank's updated shard of every bucket, to every rank."""
        if not self.distributed or self.topology.data_context_parallel_size == 1:
            return
        handles = []
        for bucket in self.buckets:
            group = self.topology.group(bucket.group)
            if group is None:
                continue
            lo, hi = self.shard_of(bucket)
            full = self.param_data[bucket.start : bucket.end]
            handles.append(comm.all_gather_into(full, self.param_data[lo:hi], group, True))
        for handle in handles:
            handle.wait()


def _group_size(topology: Topology, group: str) -> int:
    """Ranks in ``group`` ("dpcp" or "edpcp")."""
    if group == "edpcp":
        return topology.expert_data_context_parallel_size
    return topology.data_context_parallel_size
